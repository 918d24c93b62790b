"""deltarl.actor (see docs/architecture in DESIGN.md)."""
