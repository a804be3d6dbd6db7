"""References to FX nodes in the passes' frozen results.

An analysis result names each node it is about twice: by **name** (a string, for reports, dumps,
JSON and equality: two traces of one model give equal plans) and by **reference** (the
``torch.fx.Node`` itself, which the rewrite passes act on, so that no pass looks a node up again
by its name). A reference field is declared with :func:`node_ref`: it is left out of ``==``,
``hash`` and ``repr``, and :func:`plain_dict` (``dataclasses.asdict`` without references) leaves it
out of JSON. A reference points into the graphs the analysis read; a rewrite checks that they are
the graphs it rewrites.
"""

from __future__ import annotations

import copy
import dataclasses

import torch.fx as fx

__all__ = ["NODE_REF", "node_ref", "plain_dict"]

NODE_REF = "trinity_node_ref"
"""``dataclasses.field`` metadata key marking a field that holds node references."""


def node_ref(default=None):
    """A dataclass field holding ``torch.fx.Node`` references (a node, a tuple of nodes or a dict
    keyed by nodes): not compared, not hashed, not in ``repr`` nor in :func:`plain_dict`."""
    if isinstance(default, (dict, list, set)):
        kind = type(default)
        return dataclasses.field(default_factory=kind, compare=False, hash=False, repr=False, metadata={NODE_REF: True})
    return dataclasses.field(default=default, compare=False, hash=False, repr=False, metadata={NODE_REF: True})


def plain_dict(obj):
    """``dataclasses.asdict(obj)`` without the :func:`node_ref` fields (recursively, through
    dataclasses, lists, tuples and dicts), for JSON.

    Raises:
        TypeError: for a node reference in a field not declared with :func:`node_ref` (a deep copy
            of it would copy its whole graph).
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: plain_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.metadata.get(NODE_REF)
        }
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[plain_dict(v) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_dict(v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((plain_dict(k), plain_dict(v)) for k, v in obj.items())
    if isinstance(obj, fx.Node):
        raise TypeError(f"plain_dict: node {obj.name!r} in a field not declared with node_ref()")
    return copy.deepcopy(obj)
