"""Published weights that stay where they were made (issue 27, item 5: the driver out of the
data path).

A data-parallel actor's rank 0 puts the version it publishes into Ray's object store itself
(`stored`), and the driver receives only the reference, the byte count and the manifest
(`RemoteState`). The Ray rollout pool hands the reference on to every replica as it is (data-parallel ranks
always run with `placement.backend=ray`, so the rollout is that pool), and the tensors go
rank 0 -> object store -> replicas, never through the driver. Only a checkpoint of an
asynchronous lane's retained versions reads them in the driver (`local_copy`).
"""
from __future__ import annotations

from typing import Any


class RemoteState:
    """Tensors a Ray worker put in the object store (a reference, and the bytes they take)."""

    def __init__(self, ref: Any, nbytes: int) -> None:
        self.ref, self.nbytes = ref, nbytes

    def fetch(self) -> dict:
        import ray
        return ray.get(self.ref)


def local_copy(state):
    """`state` as tensors in this process: a RemoteState fetched, anything else as it is."""
    return state.fetch() if isinstance(state, RemoteState) else state


def stored(value) -> Any:
    """In a Ray actor: `value` put in the object store by this process, returned as [reference]
    (a reference inside a list reaches the caller unresolved); anywhere else, `value` itself."""
    try:
        import ray
    except ImportError:
        return value
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return value
    return [ray.put(value)]


def unlisted(value: list):
    """What a caller sent as [value] so that Ray would not resolve it: a reference read from the
    object store here, anything else as it is."""
    item = value[0]
    try:
        import ray
    except ImportError:
        return item
    return ray.get(item) if isinstance(item, ray.ObjectRef) else item


def received(value, nbytes: int):
    """What `stored` returned, on the caller's side: a RemoteState, or the value itself."""
    return RemoteState(value[0], nbytes) if isinstance(value, list) else value
