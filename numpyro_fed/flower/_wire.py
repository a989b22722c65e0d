"""What crosses Flower's wire: pytrees of arrays as a structure (JSON, no code) and a list
of NumPy arrays (Flower's ``ArrayRecord``, saved without pickle).

Nothing here unpickles: a structure names tuples, lists, dicts, ``None``, NamedTuples and a
node's :class:`~numpyro_fed.GroupIndex` declarations (their plate and group count);
a NamedTuple is resolved among the modules the receiving process has already imported (the
receiver built the same program, so it has them), never imported on a message's word.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import jax

__all__ = ["decode_description", "decode_tree", "encode_description", "encode_tree", "tree_leaves"]

_LEAF = "*"


def _is_group_index(obj) -> bool:
    """Whether ``obj`` is a :class:`~numpyro_fed.GroupIndex` (none can exist before its module
    is imported: a node's light process does not import it for nothing)."""
    module = sys.modules.get("numpyro_fed.potential.deployment")
    return module is not None and isinstance(obj, module.GroupIndex)


def _structure(obj):
    """The JSON-able structure of a Python pytree whose leaves are anything that is not a
    tuple, list, dict or ``None``."""
    if obj is None:
        return None
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        cls = type(obj)
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}", "items": [_structure(x) for x in obj]}
    if isinstance(obj, tuple):
        return {"tuple": [_structure(x) for x in obj]}
    if isinstance(obj, list):
        return {"list": [_structure(x) for x in obj]}
    if isinstance(obj, dict):
        keys = list(obj)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"only dicts with string keys cross Flower's wire, not keys {keys!r}")
        return {"dict": [[k, _structure(obj[k])] for k in sorted(keys)]}
    if _is_group_index(obj):  # a node's declaration of its groups: the plate and the count
        return {"group_index": [obj.plate, obj.num_groups], "index": _structure(obj.index)}
    return _LEAF


def encode_tree(tree) -> tuple[str, list]:
    """``(structure, leaves)`` of a pytree of arrays: the structure as a JSON string, the
    leaves as NumPy arrays (``jax.tree_util`` order). Refuses registered pytree classes other
    than tuples, lists, dicts and NamedTuples (a ``TypeError`` naming the type)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    marked = jax.tree_util.tree_unflatten(treedef, [_Marker()] * len(leaves))
    _check_plain(marked)
    return json.dumps(_structure(marked)), [np.asarray(x) for x in leaves]


class _Marker:
    """A leaf placeholder."""


def _check_plain(obj):
    if obj is None or isinstance(obj, _Marker):
        return
    if isinstance(obj, (tuple, list)):
        for x in obj:
            _check_plain(x)
        return
    if isinstance(obj, dict):
        for x in obj.values():
            _check_plain(x)
        return
    if _is_group_index(obj):
        _check_plain(obj.index)
        return
    raise TypeError(
        f"a {type(obj).__name__} does not cross Flower's wire: send tuples, lists, dicts and NamedTuples of arrays"
    )


def _resolve(name: str):
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if not (isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")):
        raise ValueError(
            f"a message names the NamedTuple {name!r}, which this process has not imported "
            "(the server and the nodes must run the same app)"
        )
    return obj


def _build(structure, leaves):
    if structure is None:
        return None
    if structure == _LEAF:
        return next(leaves)
    if "namedtuple" in structure:
        return _resolve(structure["namedtuple"])(*[_build(x, leaves) for x in structure["items"]])
    if "tuple" in structure:
        return tuple(_build(x, leaves) for x in structure["tuple"])
    if "list" in structure:
        return [_build(x, leaves) for x in structure["list"]]
    if "dict" in structure:
        return {k: _build(x, leaves) for k, x in structure["dict"]}
    if "group_index" in structure:
        from numpyro_fed.potential.deployment import GroupIndex

        plate, num_groups = structure["group_index"]
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(GroupIndex(str(plate), np.zeros(1, np.int64), int(num_groups))),
            [_build(structure["index"], leaves)],
        )
    raise ValueError(f"unknown structure in a message: {structure!r}")


def decode_tree(structure: str, leaves) -> object:
    """The pytree :func:`encode_tree` encoded."""
    it = iter(list(leaves))
    out = _build(json.loads(structure), it)
    if next(it, None) is not None:
        raise ValueError("a message holds more arrays than its structure names")
    return out


def tree_leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree)


# -- descriptions: what a node reports of its model arguments (shapes, dtypes, settings) -------


def encode_description(described) -> str:
    """JSON of :func:`~numpyro_fed.federation.base.describe_arguments`' output: each
    ``ShapeDtypeStruct`` as its shape and dtype, each scalar setting as its value."""
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(described, is_leaf=is_leaf)
    marked = jax.tree_util.tree_unflatten(treedef, [_Marker()] * len(leaves))
    _check_plain(marked)
    items = []
    for leaf in leaves:
        if is_leaf(leaf):
            items.append({"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).str})
        elif isinstance(leaf, (bool, int, float, str)):
            items.append({"value": leaf})
        else:
            raise TypeError(
                f"a loader's setting of type {type(leaf).__name__} cannot be described: "
                "give settings as bool, int, float or str"
            )
    return json.dumps({"structure": _structure(marked), "leaves": items})


def decode_description(text: str):
    data = json.loads(text)
    leaves = [
        jax.ShapeDtypeStruct(tuple(item["shape"]), np.dtype(item["dtype"])) if "shape" in item else item["value"]
        for item in data["leaves"]
    ]
    return _build(data["structure"], iter(leaves))
