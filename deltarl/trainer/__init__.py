"""deltarl.trainer (see docs/architecture in DESIGN.md)."""
