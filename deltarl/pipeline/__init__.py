"""deltarl.pipeline (see docs/architecture in DESIGN.md)."""
