"""WAN emulation without root: an asyncio TCP proxy with delay, per-connection window and a shared
rate (:class:`EmulatedLink`). For the root-only kernel recipe see ``infra/netns-regions.sh``."""

from deltarl.netem.link import EmulatedLink, LinkStats

__all__ = ["EmulatedLink", "LinkStats"]
