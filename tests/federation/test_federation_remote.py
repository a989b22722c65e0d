"""The traceable side that every engine backend shares (RemoteFederation), on a transport
whose clients are in this process: no Ray, no Flower, fast. Ray and Flower implement the same
four hooks, so what holds here holds there (their own tests run the engines)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro_fed as nf
from numpyro_fed.federation import ClientError, ClientProgram
from numpyro_fed.federation.base import block_spec
from numpyro_fed.federation.remote import RemoteFederation
from numpyro_fed.flower import FlowerFederation


@jax.tree_util.register_pytree_node_class
class MemoryFederation(RemoteFederation):
    """Clients in this process, behind the four transport hooks. ``dead``: clients that fail."""

    def __init__(self):
        super().__init__()
        self.dead = set()
        self.states = {}  # client -> {version: state}
        self.sent = []  # (name, client, Call) of every request, as a transport sees it

    def start_clients(self, program):
        return [block_spec(block) for block in program.blocks]

    def _answer(self, name, calls):
        for m, call in calls.items():
            self.sent.append((name, m, call))
        failed = sorted(set(calls) & self.dead)
        if failed:
            raise ClientError(f"call '{name}': client(s) {failed} died", clients=failed, call=name)

    def send_calls(self, name, calls):
        self._answer(name, calls)
        fn = self.program.functions[name]
        out = {}
        for m, call in calls.items():
            if call.in_axes is not None:
                fn_m = jax.vmap(fn, in_axes=(None,) + tuple(call.in_axes))
            else:
                fn_m = fn
            out[m] = jax.tree.map(np.asarray, fn_m(self.program.blocks[m], *call.args))
        return out

    def send_stateful_calls(self, name, calls):
        self._answer(name, calls)
        fn = self.program.stateful[name]
        out = {}
        for m, call in calls.items():
            held = self.states[m]
            if call.version not in held:
                raise ClientError(f"client {m} holds no client state of version {call.version}", clients=[m])
            new_state, reply = fn(self.program.blocks[m], held[call.version], *call.args)
            self.states[m] = {call.version: held[call.version], call.version + 1: new_state}
            out[m] = (reply, call.version + 1)
        return out

    def send_initial_state(self, slices):
        for m, value in slices.items():
            self.states[m] = {0: value}


def rows(n, m):
    return jnp.arange(n * 2.0).reshape(n, 2) + 10.0 * m


def weighted(block, w, shift):
    """A reply of fixed shape (2,) whatever the client's number of rows."""
    return block.sum(0) * w + shift


def accumulate(block, total, w):
    total = total + block.sum(0) * w
    return total, total.sum()


def program(sizes=(2, 3, 1), **functions):
    functions = functions or {"weighted": weighted}
    blocks = [rows(n, m) for m, n in enumerate(sizes)]
    return ClientProgram(functions, blocks=blocks, stateful={"accumulate": accumulate})


def expected(w, shift, sizes=(2, 3, 1)):
    return np.stack([np.asarray(rows(n, m)).sum(0) * w + shift[m] for m, n in enumerate(sizes)])


def test_map_and_one_in_jit_and_over_chains():
    fed = MemoryFederation().start(program())
    shift = jnp.array([1.0, 2.0, 3.0])
    ws = jnp.array([0.5, 1.0, 2.0, -1.0])  # 4 chains
    replies = jax.jit(jax.vmap(lambda w: fed.map("weighted", w, per_client=(shift,))))(ws)
    assert replies.shape == (4, 3, 2)
    for b, w in enumerate(ws):
        np.testing.assert_allclose(replies[b], expected(float(w), np.asarray(shift)))
    # one request per client carried the 4 chains (vmapped there), counted as 4 messages
    assert [(m, call.in_axes) for _, m, call in fed.sent] == [(m, (0, None)) for m in range(3)]
    ledger = fed.ledger.summary()
    np.testing.assert_array_equal(ledger["weighted/messages_to_client"], [4] * 3)
    np.testing.assert_array_equal(ledger["weighted/bytes_to_client"], [ws.nbytes + shift[0].nbytes] * 3)
    np.testing.assert_array_equal(ledger["weighted/bytes_from_client"], [replies[:, 0].nbytes] * 3)
    assert fed.ledger.round_trips == 1

    # one client per chain, traced: a request to each client chosen, with its chains only
    fed.sent.clear()
    clients = jnp.array([2, 0, 2, 1])
    one = jax.jit(jax.vmap(lambda c, w: fed.one("weighted", c, w, own=(shift,))))(clients, ws)
    for b, (c, w) in enumerate(zip(clients, ws)):
        np.testing.assert_allclose(one[b], expected(float(w), np.asarray(shift))[int(c)])
    assert sorted(m for _, m, _ in fed.sent) == [0, 1, 2]
    assert {m: call.args[0].shape for _, m, call in fed.sent} == {0: (1,), 1: (1,), 2: (2,)}
    np.testing.assert_array_equal(fed.ledger.summary()["weighted/messages_to_client"], [4 + 1, 4 + 1, 4 + 2])
    # an unbatched call: one message, no vmap on the client
    np.testing.assert_allclose(
        jax.jit(lambda: fed.one("weighted", 1, 3.0, own=(shift,)))(), expected(3.0, np.asarray(shift))[1]
    )
    assert fed.sent[-1][2].in_axes is None


def test_stateful_calls_keep_versions_and_state_on_the_clients():
    fed = MemoryFederation().start(program())
    cs = fed.init_state(jnp.zeros((3, 2)))
    assert jax.tree.leaves(cs.values) == [] and cs.version.tolist() == [0, 0, 0]

    @jax.jit
    def calls(cs):
        cs, r1 = fed.map("accumulate", 2.0, state=cs)
        cs, r2 = fed.one("accumulate", jnp.array([2, 0]), 1.0, state=cs)
        cs, r3 = fed.one("accumulate", 1, -1.0, state=cs)
        return cs, (r1, r2, r3)

    cs, (r1, r2, r3) = calls(cs)
    np.testing.assert_array_equal(cs.version, [2, 2, 2])
    sums = [np.asarray(rows(n, m)).sum(0) for m, n in enumerate((2, 3, 1))]
    np.testing.assert_allclose(r1, [(2.0 * s).sum() for s in sums])
    np.testing.assert_allclose(r2, [(3.0 * sums[2]).sum(), (3.0 * sums[0]).sum()])
    np.testing.assert_allclose(r3, (1.0 * sums[1]).sum())
    # each call named the version its client was at; the state never crossed
    assert [(m, call.version) for _, m, call in fed.sent] == [(0, 0), (1, 0), (2, 0), (2, 1), (0, 1), (1, 1)]
    ledger = fed.ledger.summary()
    np.testing.assert_array_equal(ledger["accumulate/rounds"], [2, 2, 2])
    np.testing.assert_array_equal(ledger["accumulate/bytes_from_client"], [2 * r3.nbytes] * 3)
    # a retried call (from the version before) is a pure function of it: the same reply
    _, again = jax.jit(lambda cs: fed.one("accumulate", 1, -1.0, state=cs))(cs._replace(version=cs.version - 1))
    np.testing.assert_allclose(again, r3)


def mixed(block, state, flags, counts, key, scale, small):
    """A stateful call whose arguments have five dtypes and shapes from 0-d to 2-d."""
    total = state + jnp.where(flags, block.sum(0), 0.0) * scale + counts.sum() + small.astype(jnp.float32).sum()
    return total, (total, key, flags)


def test_stateful_arguments_cross_as_one_buffer_with_their_dtypes():
    """A stateful call's arguments reach the host callback packed in one byte vector (one
    device transfer instead of one per argument): the clients get every array back with its
    dtype, shape and values, and the ledger counts the arrays' own bytes."""
    fed = MemoryFederation().start(
        ClientProgram({}, blocks=[rows(n, m) for m, n in enumerate((2, 3, 1))], stateful={"mixed": mixed})
    )
    cs = fed.init_state(jnp.zeros((3, 2)))
    flags = jnp.array([True, False])
    counts = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)  # one row per client
    key = jax.random.split(jax.random.PRNGKey(3), 3)  # uint32, per client
    scale = jnp.full(3, 0.5, jnp.float32)
    small = jnp.array([[1], [-2], [3]], jnp.int8)
    own = (counts, key, scale, small)

    def mixed_call(cs):
        return fed.map("mixed", flags, per_client=own, state=cs)

    callbacks = [e for e in jax.make_jaxpr(mixed_call)(cs).eqns if e.primitive.name == "pure_callback"]
    assert [[v.aval.dtype for v in e.invars] for e in callbacks] == [[jnp.uint8]]
    cs, (total, keys, back) = jax.jit(mixed_call)(cs)
    for m, (_, _, call) in enumerate(fed.sent):
        got = jax.tree.leaves(call.args)
        want = [flags] + [a[m] for a in own]
        assert [(a.dtype, a.shape) for a in got] == [(np.dtype(w.dtype), w.shape) for w in want]
        for a, w in zip(got, want):
            np.testing.assert_array_equal(a, w)
        assert call.nbytes == sum(w.nbytes for w in want)
    np.testing.assert_array_equal(keys, key)
    np.testing.assert_array_equal(back, np.broadcast_to(flags, (3, 2)))
    sums = [np.asarray(rows(n, m)).sum(0) for m, n in enumerate((2, 3, 1))]
    np.testing.assert_allclose(
        total, [np.where(flags, sums[m], 0.0) * 0.5 + counts[m].sum() + small[m, 0] for m in range(3)]
    )
    # a stateful call under a vmap over chains is still refused, naming the call
    with pytest.raises(Exception, match="call 'mixed' with a client state cannot be batched"):
        jax.jit(jax.vmap(lambda s: fed.map("mixed", flags, per_client=(counts, key, s * scale, small), state=cs)))(
            jnp.ones(2)
        )


def test_replies_whose_shape_depends_on_the_rows_are_refused():
    # clients hold 2, 3 and 1 rows; a reply of one number per row differs between clients
    fed = MemoryFederation().start(program(per_row=lambda block, w: block[:, 0] * w))
    for call in (lambda: fed.map("per_row", 1.0), lambda: fed.one("per_row", 0, 1.0)):
        with pytest.raises(
            ValueError,
            match=r"client 1's reply has shape .*\(3,\).* client 0's .*\(2,\).*"
            "must not depend on the number of rows",
        ):
            jax.jit(call)()
    stateful = MemoryFederation().start(
        ClientProgram({}, blocks=[rows(2, 0), rows(1, 1)], stateful={"grow": lambda block, s, w: (s, block[:, 0] * w)})
    )
    cs = stateful.init_state(jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="client 1's reply has shape"):
        stateful.map("grow", 1.0, state=cs)
    assert stateful.sent == []  # refused before anything was sent


def test_bad_client_indices_and_failures_are_client_errors():
    fed = MemoryFederation().start(program())
    with pytest.raises(ClientError, match="no client 5 .there are 3") as info, fed.guard():
        jax.jit(lambda c: fed.one("weighted", c, 1.0, own=(jnp.zeros(3),)))(5)
    assert info.value.clients == (5,)
    cs = fed.init_state(jnp.zeros((3, 2)))
    with pytest.raises(ClientError, match="must be distinct clients among 0..2"), fed.guard():
        fed.one("accumulate", jnp.array([1, 1]), 1.0, state=cs)
    fed.dead.add(1)
    with pytest.raises(ClientError, match=r"client\(s\) \[1\] died") as info, fed.guard():
        jax.jit(lambda: fed.map("weighted", 1.0, per_client=(jnp.zeros(3),)))()
    assert info.value.clients == (1,) and info.value.call == "weighted"
    with pytest.raises(ValueError, match="cannot be batched .* over chains on MemoryFederation"), fed.guard():
        jax.vmap(lambda w: fed.map("accumulate", w, state=cs))(jnp.ones(2))


def test_engines_share_the_base():
    for engine in (nf.RayFederation, FlowerFederation):
        assert issubclass(engine, RemoteFederation)
        for name in ("map", "one", "init_state", "guard", "block_specs"):
            assert getattr(engine, name) is getattr(RemoteFederation, name), (engine, name)
