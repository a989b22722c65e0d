"""What a deployed node keeps on its own disk so that a message need not rebuild the program.

A deployed SuperNode starts a new ``ClientApp`` process for every message. Without this store
each process rebuilds the client program from the recipe (the model traced to split it) and
traces and lowers the function it runs before JAX's persistent cache can serve the
executable. At its first message for a run the node stores, in its own cache folder (next to
JAX's persistent cache: the node config's ``jax-cache-dir``):

* its **block** (the client's rows as the program arranges them), under a key of the run's
  recipe, the client and a digest of the rows the app's loader returns, so that other rows,
  even of the same shapes, never meet a stored block;
* each function it ran, **exported** with :func:`jax.export.export` (StableHLO: the same
  computation, no Python code), under a key of the block's, the function, its batching and
  its arguments' shapes and dtypes.

A later message finds both, loads the rows to check their digest, and runs the exported
function on the stored block: no program rebuilt, no tracing. Nothing of it crosses the wire:
the node exports and stores its own functions. A function that cannot be exported (a host
callback) is marked so and runs the usual way.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

import jax

__all__ = ["ExportStore", "rows_digest", "signature"]

_FOLDER = "numpyro_fed_exported"
#: the runs (blocks, with their functions) a node keeps; the least recently used go first
MAX_BLOCKS = 8


def rows_digest(rows) -> str:
    """A digest of what the app's loader returned (every array's dtype, shape and bytes, every
    other leaf's ``repr``, and the tree's structure)."""
    leaves, treedef = jax.tree_util.tree_flatten(rows)
    h = hashlib.sha256(str(treedef).encode())
    for leaf in leaves:
        if isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
            array = np.ascontiguousarray(np.asarray(leaf))
            h.update(f"{array.dtype.str}{array.shape}".encode())
            h.update(array.tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()[:32]


def signature(*parts) -> str:
    """A digest of what a stored function is compiled for: ``parts`` (names, structures) and
    the shapes and dtypes of the array lists among them, with JAX's version."""
    text = []
    for part in parts:
        if isinstance(part, (list, tuple)) and all(hasattr(x, "shape") for x in part):
            text.append([[list(np.shape(x)), np.asarray(x).dtype.str] for x in part])
        else:
            text.append(repr(part))
    return hashlib.sha256(json.dumps([text, jax.__version__]).encode()).hexdigest()[:32]


class ExportStore:
    """The node's stored blocks and exported functions, in ``folder``. Everything is kept as
    flat lists of arrays (a block's leaves; a function of its arguments' leaves returning its
    result's leaves): a node's later message reads its arrays and writes its reply without
    rebuilding the trees, or importing the modules whose classes they hold."""

    def __init__(self, folder):
        self.folder = str(folder)

    @classmethod
    def for_node(cls, cache_dir) -> "ExportStore | None":
        """The store next to JAX's persistent cache ``cache_dir`` (``""``: no cache, no store)."""
        return None if not cache_dir else cls(os.path.join(cache_dir, _FOLDER))

    def _path(self, name):
        return os.path.join(self.folder, name)

    def _write(self, name, data: bytes):
        """Atomically (several nodes of one machine may share the folder); readable by the
        node's user only (a block is the node's rows)."""
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(name))
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    # -- blocks ------------------------------------------------------------------------------
    def load_block(self, key) -> list | None:
        """The leaves of the block stored under ``key`` (``None``: none is)."""
        path = self._path(f"{key}.block.npz")
        if not os.path.exists(path):
            return None
        os.utime(path)  # used: the last to be pruned
        with np.load(path, allow_pickle=False) as data:
            return [data[f"leaf{i}"] for i in range(len(data.files))]

    def save_block(self, key, leaves) -> list:
        import io

        leaves = [np.asarray(x) for x in leaves]
        buffer = io.BytesIO()
        np.savez(buffer, **{f"leaf{i}": x for i, x in enumerate(leaves)})
        self._write(f"{key}.block.npz", buffer.getvalue())
        self._prune()
        return leaves

    def _prune(self):
        """Keeps the :data:`MAX_BLOCKS` most recently used blocks and their functions (whose
        names start with the block's key): every run stores its block anew (its recipe's key
        is new), and a node's cache folder must not grow with the runs."""
        names = os.listdir(self.folder)
        blocks = sorted(
            (n for n in names if n.endswith(".block.npz")), key=lambda n: os.path.getmtime(self._path(n)), reverse=True
        )
        for old in blocks[MAX_BLOCKS:]:
            prefix = old[: -len(".block.npz")]
            for name in names:
                if name.startswith(prefix):
                    try:
                        os.remove(self._path(name))
                    except FileNotFoundError:  # another node of this machine pruned it first
                        pass

    # -- functions ---------------------------------------------------------------------------
    def load_function(self, key):
        """``(header, fn)`` stored under ``key`` (which starts with its block's key), ``fn(*leaves)
        -> result leaves``; ``False`` where the function was found not exportable; ``None``
        where nothing is stored."""
        if os.path.exists(self._path(f"{key}.none")):
            return False
        path = self._path(f"{key}.jaxexp")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            header, data = f.read().split(b"\n", 1)
        return _runner(json.loads(header), data)

    def save_function(self, key, fn, tree, leaves, describe=None):
        """Exports ``fn`` (of the tree ``tree`` of arguments, for ``leaves``' shapes and dtypes)
        as a function of the leaves returning its result's leaves, and stores it with the
        header ``describe(result)`` (a JSON-able dict of what the caller needs to read the
        result's leaves); returns it as :meth:`load_function` does. Where it cannot be
        exported, stores that (and why), so that later messages do not try again, and returns
        ``False``."""
        from jax import export

        header = {}

        def flat(*leaves):
            out = fn(*jax.tree_util.tree_unflatten(tree, leaves))
            if describe is not None:
                header.update(describe(out))
            return jax.tree_util.tree_leaves(out)

        specs = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in leaves]
        try:
            data = bytes(export.export(jax.jit(flat))(*specs).serialize())
        except ImportError:  # serialization needs flatbuffers (the flower extra installs it)
            return False
        except Exception as exc:  # a host callback, a result the wire cannot encode: run it the usual way
            self._write(f"{key}.none", f"{type(exc).__name__}: {exc}".encode())
            return False
        self._write(f"{key}.jaxexp", json.dumps(header).encode() + b"\n" + data)
        return _runner(header, data)


def _runner(header: dict, data: bytes):
    """``(header, fn)``: the exported function serialized in ``data`` as ``fn(*leaves) ->
    result leaves``."""
    from jax import export

    exported = export.deserialize(bytearray(data))

    def run(*leaves):
        return [np.asarray(x) for x in exported.call(*leaves)]

    return header, run
