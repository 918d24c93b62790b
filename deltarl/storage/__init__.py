"""deltarl.storage (see docs/architecture in DESIGN.md)."""
