"""deltarl.storage: the object-store interface, its backends, and the run namespace on top of them."""

# --- object stores (interface, backends, factory) ------------------------------------------------
from deltarl.storage.local import LocalStore
from deltarl.storage.memory import MemoryStore
from deltarl.storage.open import open_store
from deltarl.storage.store import ObjectInfo, ObjectStore

__all__ = [
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectStore",
    "open_store",
]
