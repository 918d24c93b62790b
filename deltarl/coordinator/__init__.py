"""deltarl.coordinator (see docs/architecture in DESIGN.md)."""
