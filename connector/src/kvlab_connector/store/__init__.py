"""The store: objects striped over drives; their format, ledger, reader, writer and memory media.

Callers outside the store import `Store` and `ObjectShape` from here; the store's parts import
their siblings, never this façade."""

from kvlab_connector.store.format import ObjectShape
from kvlab_connector.store.store import Store

__all__ = ["ObjectShape", "Store"]
