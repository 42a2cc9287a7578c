"""Multi-rank checker for boundary communicators, against a single-process reference.

The reference of one batch window is global: per-sample token counts C (some
zero), the packed boundary tensor X [sum(C), H] and a weight W of the same
shape; the loss is sum(out * W), so the exact gradient of X is W. Every rank
regenerates the same X, C, W from the case's seed. Destination ranks check the
shard they receive against X's slice of their interval and feed back their
local part of dL/dout: a TP replica feeds the same gradient as its siblings,
CP rank c feeds W masked to the tokens t with t % cp == c (the chunk it
"uses"), so the CP partials sum to W. Source ranks check the gradient they get
against W's slice of their interval. Expected values go through the wire dtype
exactly as the communicator rounds them, so comparisons are exact.

Errors are collected (not raised) so one run reports every mismatch and a
deliberately broken routing can be shown to be caught by the same checker.

Every case also logs what crosses the wire during comm.forward / comm.backward, as
torch.distributed sees it (`WireLog`: each tensor handed to batch_isend_irecv, broadcast, reduce
and all_reduce, with its bytes), so traffic tests compare observed bytes, not the communicator's
own `Traffic` counters, with what the shapes say.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

from mimo.comm import EdgePlan, boundary_transform, build_communicator, get_group, make_plan
from mimo.comm.plan import Pieces
from mimo.topology import Layout
from mimo.topology.grid import build_module_grid

HIDDEN = 3
WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lay(tp=1, cp=1, dp=1, pp=1, off=0):
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, rank_offset=off)


def case(name, src, dst, B, wire="fp32", windows=2, mode="halves", broken=None):
    return dict(name=name, src=src, dst=dst, B=B, wire=wire, windows=windows, mode=mode, broken=broken)


def window_data(c, w):
    """(counts, X, W) of window w of case c: identical on every rank and in the test process."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{c['name']}/{w}".encode()))  # str hash() differs per process
    B = c["B"]
    counts = torch.randint(0, 4, (B,), generator=g, dtype=torch.int64)
    counts[int(torch.randint(0, B, (1,), generator=g))] = 0  # always at least one sample without tokens
    total = int(counts.sum())
    X = torch.randn(total, HIDDEN, generator=g)
    W = torch.randn(total, HIDDEN, generator=g)
    return counts, X, W


def shard_slice(counts, start, stop):
    """Token range [t0, t1) of samples [start, stop)."""
    t0 = int(counts[:start].sum())
    return t0, t0 + int(counts[start:stop].sum())


class _IntervalPlan(EdgePlan):
    """A plan whose pieces come from its (overridden) shard intervals by brute force: the broken plans'
    intervals are out of order, which the real plan's bounds cannot express."""

    def _pieces(self):
        found = sorted((max(s0, d0), min(s1, d1), i, j)
                       for i, (s0, s1) in ((i, self.src_interval(i)) for i in range(self.src.dp))
                       for j, (d0, d1) in ((j, self.dst_interval(j)) for j in range(self.dst.dp))
                       if max(s0, d0) < min(s1, d1))
        cols = [np.array([f[c] for f in found], dtype=np.int64) for c in range(4)]
        return Pieces(*cols)

    def pieces_of_src(self, i):
        return [p for p in self.pieces if p.i == i]

    def pieces_of_dst(self, j):
        return [p for p in self.pieces if p.j == j]


class SwappedDstPlan(_IntervalPlan):
    """Deliberately wrong: destination shards 0 and 1 trade batch intervals."""

    def dst_interval(self, j):
        return super().dst_interval({0: 1, 1: 0}.get(j, j))


class SwappedSrcPlan(_IntervalPlan):
    """Deliberately wrong: source shards 0 and 1 trade batch intervals."""

    def src_interval(self, i):
        return super().src_interval({0: 1, 1: 0}.get(i, i))


BROKEN = {"swap_dst": SwappedDstPlan, "swap_src": SwappedSrcPlan}


def pad_one_row(comm):
    """Deliberately wasteful: every activation / gradient message carries one extra row, which the
    receiver drops. Outputs and gradients stay exact and the communicator's own `Traffic`
    counters (taken from the unpadded tensors) do not change: only the wire shows it."""
    inner = comm.exchange

    def exchange(sends, recvs):
        def bigger(t):
            return t.dim() == 2 and t.numel() > 0

        sends = [(torch.cat([t, t[-1:]]) if bigger(t) else t, peer) for t, peer in sends]
        bufs = [(t.new_empty(t.shape[0] + 1, t.shape[1]) if bigger(t) else t, peer) for t, peer in recvs]
        inner(sends, bufs)
        for (t, _), (b, _) in zip(recvs, bufs):
            if b is not t:
                t.copy_(b[:-1])

    comm.exchange = exchange


class WireLog:
    """What this rank hands torch.distributed while a communicator's forward or backward runs:
    one record per tensor (`op` send / recv / broadcast / reduce / all_reduce, `peer` for P2P,
    `root` and `ranks` for collectives, `nbytes`, `dtype`). Installed per rank process by
    `run_cases`; nothing is recorded outside `comm.forward` / `comm.backward` (so the harness's
    own collectives, e.g. megatron's TP all-reduce, stay out)."""

    def __init__(self):
        self.phase = None
        self.records = []
        self._saved = {}

    def _add(self, op, t, **kw):
        if self.phase is not None:
            self.records.append(dict(phase=self.phase, op=op, nbytes=t.numel() * t.element_size(),
                                     dtype=str(t.dtype).replace("torch.", ""), **kw))

    def install(self):
        orig = {n: getattr(dist, n) for n in ("batch_isend_irecv", "broadcast", "reduce", "all_reduce")}
        self._saved = orig

        def ranks_of(group):
            return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                name = getattr(op.op, "__name__", str(op.op))
                self._add("send" if name == "isend" else "recv", op.tensor, peer=op.peer)
            return orig["batch_isend_irecv"](p2p_op_list)

        def collective(name, root_arg):
            def call(tensor, *args, **kwargs):
                root = kwargs.get(root_arg, args[0] if args and root_arg else None)
                self._add(name, tensor, root=root, ranks=ranks_of(kwargs.get("group")))
                return orig[name](tensor, *args, **kwargs)
            return call

        dist.batch_isend_irecv = batch_isend_irecv
        dist.broadcast = collective("broadcast", "src")
        dist.reduce = collective("reduce", "dst")
        dist.all_reduce = collective("all_reduce", None)

    def uninstall(self):
        for n, f in self._saved.items():
            setattr(dist, n, f)
        self._saved = {}

    def watch(self, comm):
        """Record while comm.forward / comm.backward run (on this instance only)."""
        for method, phase in (("forward", "fwd"), ("backward", "bwd")):
            inner = getattr(comm, method)

            def call(*args, _inner=inner, _phase=phase, **kwargs):
                before, self.phase = self.phase, _phase
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self.phase = before
            setattr(comm, method, call)


_WIRE = WireLog()


def _rounded(t, wire):
    return t.to(WIRE[wire]).to(torch.float32)


def run_case(c):
    rank = dist.get_rank()
    src, dst = Layout(**c["src"]), Layout(**c["dst"])
    truth = make_plan(src, dst, c["B"])
    plan = BROKEN[c["broken"]](src, dst, c["B"]) if c["broken"] in BROKEN else truth
    module_groups = None
    if c["mode"] == "known":  # as the trainer builds it: over the groups of the two modules' grids
        module_groups = (build_module_grid("src", src).groups, build_module_grid("dst", dst).groups)
    real_new_group, made = dist.new_group, []
    dist.new_group = lambda *a, **k: made.append(a) or real_new_group(*a, **k)
    try:
        comm = build_communicator(src, dst, c["B"], HIDDEN, torch.float32, WIRE[c["wire"]], plan=plan,
                                  module_groups=module_groups)
    finally:
        dist.new_group = real_new_group
    errors = []
    if module_groups is not None:  # the grids swapped: a rank in an edge group must refuse them
        in_group = any(rank in g for gs in truth.groups().values() for g in gs)
        try:
            build_communicator(src, dst, c["B"], HIDDEN, module_groups=module_groups[::-1])
            if in_group:
                errors.append(f"rank {rank}: the other module's groups were taken for the edge's")
        except RuntimeError as e:
            if not in_group or "boundary group" not in str(e):
                errors.append(f"rank {rank}: {e}")
    if c["broken"] == "extra_row":
        pad_one_row(comm)
    _WIRE.records = []
    _WIRE.watch(comm)
    role = truth.role(rank)
    tp_groups = {}
    if c["mode"] == "megatron_tp":  # collective: every rank creates the destination's first-stage TP groups
        for j in range(dst.dp):
            for cc in range(dst.cp):
                ranks = [dst.rank(tp=t, cp=cc, dp=j, pp=0) for t in range(dst.tp)]
                tp_groups[tuple(ranks)] = get_group(ranks) if len(ranks) > 1 else None
    data = [window_data(c, w) for w in range(c["windows"])]

    def src_part(w):
        counts, X, W = data[w]
        s0, s1 = truth.src_interval(role.src_shard)
        t0, t1 = shard_slice(counts, s0, s1)
        return counts[s0:s1].clone(), X[t0:t1].clone(), W[t0:t1].clone()

    def dst_part(w):
        counts, X, W = data[w]
        d0, d1 = truth.dst_interval(role.dst_shard)
        t0, t1 = shard_slice(counts, d0, d1)
        return counts[d0:d1].clone(), X[t0:t1].clone(), W[t0:t1].clone()

    def cp_mask(n):
        cp, cc = dst.cp, role.dst_coords["cp"]
        return (torch.arange(n) % cp == cc).to(torch.float32).unsqueeze(1)

    def check_out(w, out, got_counts):
        if role.dst_shard is None:
            if out is not None:
                errors.append(f"w{w} rank {rank}: got an output but is no destination rank")
            return
        exp_counts, exp_x, _ = dst_part(w)
        if out is None:
            errors.append(f"w{w} rank {rank}: no output on destination shard {role.dst_shard}")
        elif got_counts is None or not torch.equal(got_counts, exp_counts):
            errors.append(f"w{w} rank {rank}: out counts {got_counts} != expected {exp_counts}")
        elif out.shape != exp_x.shape or not torch.equal(out, _rounded(exp_x, c["wire"])):
            errors.append(f"w{w} rank {rank}: out mismatch on destination shard {role.dst_shard}")

    def dst_grad(w, out):
        _, _, exp_w = dst_part(w)
        if out is None or out.shape != exp_w.shape:
            return None if out is None else torch.zeros_like(out)  # keep the collectives going
        return exp_w * cp_mask(exp_w.shape[0])

    def check_grad(w, g):
        if role.src_shard is None:
            if g is not None:
                errors.append(f"w{w} rank {rank}: got a gradient but holds no source shard")
            return
        _, _, exp_w = src_part(w)
        if g is None:
            errors.append(f"w{w} rank {rank}: no gradient for source shard {role.src_shard}")
        elif g.shape != exp_w.shape or not torch.equal(g, _rounded(exp_w, c["wire"])):
            errors.append(f"w{w} rank {rank}: grad mismatch on source shard {role.src_shard}")

    if c["mode"] == "validate":
        errors += _validation_errors(comm, role, src_part)
    if c["mode"] in ("halves", "validate", "known"):
        outs = []
        for w in range(c["windows"]):  # all forwards first: several windows in flight, FIFO backward
            # "known": every rank knows each unit's size (as the trainer does), so no counts travel.
            window = (truth.for_window(truth.src_bounds, truth.dst_bounds, data[w][0].tolist())
                      if c["mode"] == "known" else None)
            if role.src_shard is not None:
                counts, x, _ = src_part(w)
                out = comm.forward(x, counts, window)
            else:
                out = comm.forward(None, None, window)
            check_out(w, out, comm.received_counts if out is not None else None)
            outs.append(out)
        if c["mode"] == "validate" and role.dst_shard is not None and outs[0] is not None:
            before = comm.pending
            try:
                comm.backward(torch.zeros(outs[0].shape[0] + 1, HIDDEN))
                errors.append(f"rank {rank}: a gradient of the wrong shape was accepted")
            except ValueError as e:
                if "gradient shape" not in str(e) or comm.pending != before:
                    errors.append(f"rank {rank}: bad gradient: {e} (pending {before} -> {comm.pending})")
        for w in range(c["windows"]):
            g = comm.backward(dst_grad(w, outs[w]) if role.dst_shard is not None else None)
            check_grad(w, g)
        if comm.pending:
            errors.append(f"rank {rank}: {comm.pending} forwards left without backward")
    elif c["mode"] == "autograd" and role.src_shard is not None:  # pp=1 colocated: every member is both
        counts, x, _ = src_part(0)
        x.requires_grad_(True)
        out, got_counts = boundary_transform(comm, x, counts)
        check_out(0, out.detach(), got_counts)
        (out * dst_grad(0, out.detach())).sum().backward()
        check_grad(0, x.grad)
    elif c["mode"] == "megatron_tp":
        errors += _megatron_tp_case(c, comm, truth, role, data[0], src_part, dst_part, tp_groups)
    return dict(name=c["name"], rank=rank, errors=errors, traffic=_snapshot(comm.traffic), wire=_WIRE.records,
                new_groups=len(made))


def _snapshot(traffic):
    """Plain dict (picklable): {'bytes': {'fwd/cross/payload': n, ...}, 'messages': {...}}."""
    return {"bytes": {"/".join(k): v for k, v in traffic.bytes.items()},
            "messages": {"/".join(k): v for k, v in traffic.messages.items()}}


def _megatron_tp_case(c, comm, truth, role, data, src_part, dst_part, tp_groups):
    """The TP-replica assumption, checked with megatron's own TP region op.

    On the destination, each TP rank feeds the boundary tensor into a
    column-parallel matmul through megatron's copy_to_tensor_model_parallel_region,
    whose backward all-reduces the input gradient over TP. The gradients the
    TP replicas hand to comm.backward must then be identical, and the source
    gradient must equal the single-process reference dX = V @ A^T.
    """
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    rank, errors = dist.get_rank(), []
    dst = truth.dst
    g = torch.Generator().manual_seed(7)
    cols = 4 * dst.tp
    A = torch.randn(HIDDEN, cols, generator=g)
    counts_all, X, _ = data
    V = torch.randn(X.shape[0], cols, generator=g)
    grad_in = None
    if role.src_shard is not None:
        counts, x, _ = src_part(0)
        out = comm.forward(x, counts)
    else:
        out = comm.forward(None, None)
    if role.dst_shard is not None:
        t = role.dst_coords["tp"]
        ranks = [dst.rank(tp=k, cp=role.dst_coords["cp"], dp=role.dst_shard, pp=0) for k in range(dst.tp)]
        group = tp_groups[tuple(ranks)]
        leaf = out.clone().requires_grad_(True)
        y = copy_to_tensor_model_parallel_region(leaf, group=group) if group is not None else leaf
        sl = slice(t * 4, (t + 1) * 4)
        d0, d1 = truth.dst_interval(role.dst_shard)
        t0, t1 = shard_slice(counts_all, d0, d1)
        (y @ A[:, sl] * V[t0:t1, sl]).sum().backward()
        grad_in = leaf.grad
        if group is not None:
            peers = [torch.empty_like(grad_in) for _ in ranks]
            dist.all_gather(peers, grad_in.contiguous(), group=group)
            if not all(torch.equal(p, peers[0]) for p in peers):
                errors.append(f"rank {rank}: TP replicas of destination shard {role.dst_shard} hold different gradients")
    got = comm.backward(grad_in)
    if role.src_shard is not None:
        s0, s1 = truth.src_interval(role.src_shard)
        t0, t1 = shard_slice(counts_all, s0, s1)
        ref = V[t0:t1] @ A.T
        if got is None or got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-5, atol=1e-6):
            errors.append(f"rank {rank}: megatron-TP gradient differs from the reference on source shard {role.src_shard}")
    return errors


def _validation_errors(comm, role, src_part):
    """Bad calls must fail on the calling rank, before any communication, naming the problem."""
    rank, errors = dist.get_rank(), []

    def expect(exc, words, fn, *args):
        try:
            fn(*args)
        except exc as e:
            if words not in str(e):
                errors.append(f"rank {rank}: {exc.__name__} without {words!r}: {e}")
            return
        errors.append(f"rank {rank}: no {exc.__name__} for a call that should mention {words!r}")

    expect(RuntimeError, "without a matching forward", comm.backward, None)
    if role.src_shard is not None:
        counts, x, _ = src_part(0)
        expect(ValueError, "must pass", comm.forward, None, None)
        expect(ValueError, "units", comm.forward, x, counts[:-1])
        expect(ValueError, "counts sum", comm.forward, torch.zeros(x.shape[0] + 1, HIDDEN), counts)
        expect(ValueError, f"[tokens, {HIDDEN}]", comm.forward, x[:, :-1], counts)
        expect(ValueError, "dtype", comm.forward, x.double(), counts)
        expect(ValueError, "int64", comm.forward, x, counts.int())
        expect(ValueError, "non-negative", comm.forward, x, counts - 10 * (counts == 0).long())
    else:
        expect(ValueError, "holds no source shard", comm.forward, torch.zeros(1, HIDDEN), torch.ones(1, dtype=torch.int64))
    if comm.pending:
        errors.append(f"rank {rank}: a rejected forward left state behind")
    return errors


def run_cases(cases):
    _WIRE.install()
    try:
        return [run_case(c) for c in cases]
    finally:
        _WIRE.uninstall()


# --- the default sweep: every required feature, at most 8 ranks ----------------------------------
NC = "non-colocated"
DEFAULT_CASES = [
    # non-colocated
    case("nc equal dp2", lay(dp=2), lay(dp=2, off=2), B=4),
    case("nc fan-in 2:1", lay(dp=4), lay(dp=2, off=4), B=8),
    case("nc fan-in 4:1", lay(dp=4), lay(dp=1, off=4), B=8),
    case("nc fan-out 1:2", lay(dp=1), lay(dp=2, off=1), B=4),
    case("nc fan-out 1:4", lay(dp=1), lay(dp=4, off=1), B=8),
    case("nc tp4->tp1 fan-out", lay(tp=4), lay(dp=2, off=4), B=4),
    case("nc tp1->tp4 fan-in", lay(dp=2), lay(tp=4, off=2), B=4),
    case("nc dst pp2", lay(dp=2), lay(dp=2, pp=2, off=2), B=4),
    case("nc dst cp2", lay(dp=2), lay(cp=2, dp=2, off=2), B=4),
    case("nc src pp2 -> tp2 cp2", lay(dp=2, pp=2), lay(tp=2, cp=2, off=4), B=4),
    case("nc llm-first fan-in bf16", lay(dp=4, off=4), lay(tp=2, dp=2), B=8, wire="bf16"),
    case("nc fan-in 4:1 tp2 pp2 bf16", lay(dp=4), lay(tp=2, pp=2, off=4), B=8, wire="bf16"),
    case("nc src tp2 fan-out cp2", lay(tp=2), lay(cp=2, dp=2, off=2), B=6),
    case("nc validation then fan-in", lay(dp=4), lay(tp=2, dp=2, off=4), B=8, mode="validate"),
    case("nc megatron tp4", lay(dp=2), lay(tp=4, off=2), B=4, windows=1, mode="megatron_tp"),
    case("nc known sizes fan-in tp2 cp2", lay(dp=4), lay(tp=2, cp=2, off=4), B=8, mode="known"),
    case("nc known sizes fan-out", lay(dp=1), lay(dp=2, off=1), B=4, mode="known"),
    case("nc known sizes src tp2 pp2 -> cp2", lay(tp=2, pp=2), lay(cp=2, dp=2, off=4), B=6, mode="known"),
    # colocated
    case("c equal dp2", lay(dp=2), lay(dp=2), B=4),
    case("c fan-in 2:1 tp2", lay(dp=4), lay(tp=2, dp=2), B=8),
    case("c fan-in 4:1 tp1<->4", lay(dp=4), lay(tp=4), B=8),
    case("c fan-out 1:2", lay(tp=2), lay(dp=2), B=4),
    case("c fan-out 1:4 tp4<->1", lay(tp=4), lay(dp=4), B=8),
    case("c dst pp2", lay(dp=4), lay(pp=2, dp=2), B=8),
    case("c dst cp2 fan-in", lay(dp=4), lay(cp=2, dp=2), B=8),
    case("c dp8 -> tp2 cp2 pp2 bf16", lay(dp=8), lay(tp=2, cp=2, pp=2), B=8, wire="bf16"),
    case("c src pp2 fan-out", lay(dp=2, pp=2), lay(dp=4), B=4),
    case("c tp2 dp4 -> tp4 dp2", lay(tp=2, dp=4), lay(tp=4, dp=2), B=8),
    case("c tp4 dp2 -> dp8 fan-out 1:4", lay(tp=4, dp=2), lay(dp=8), B=8),
    case("c dst pp4 fan-in 4:1", lay(dp=8), lay(dp=2, pp=4), B=8),
    case("c autograd fan-in", lay(dp=4), lay(tp=2, dp=2), B=8, windows=1, mode="autograd"),
    case("c autograd fan-out cp2", lay(tp=4), lay(cp=2, dp=2), B=4, windows=1, mode="autograd"),
    case("c autograd equal bf16", lay(dp=2), lay(dp=2), B=4, windows=1, mode="autograd", wire="bf16"),
    case("c megatron tp2", lay(dp=4), lay(tp=2, dp=2), B=8, windows=1, mode="megatron_tp"),
    case("c known sizes fan-in tp2", lay(dp=4), lay(tp=2, dp=2), B=8, mode="known"),
    case("c known sizes tp2 cp2 fan-in", lay(dp=8), lay(tp=2, cp=2, dp=2), B=8, mode="known"),
]

# Deliberately broken routings: the checker must report them.
BROKEN_CASES = [
    case("broken nc swap dst", lay(dp=4), lay(dp=2, off=4), B=8, broken="swap_dst"),
    case("broken c swap dst", lay(dp=4), lay(tp=2, dp=2), B=8, broken="swap_dst"),
    case("broken nc swap src", lay(dp=2), lay(dp=2, off=2), B=4, broken="swap_src"),
]

# Deliberately wasteful: one extra row per activation / gradient message (see `pad_one_row`).
EXTRA_ROW_CASE = case("wasteful nc extra row fan-in tp2", lay(dp=4), lay(tp=2, dp=2, off=4), B=8, broken="extra_row")


def slow_cases(world=8):
    """Every layout pair from a family of small grids that fits in `world` ranks."""
    src_grids = [dict(tp=t, dp=d, pp=p) for t in (1, 2, 4) for d in (1, 2, 4) for p in (1, 2) if t * d * p <= world]
    dst_grids = [dict(tp=t, cp=c, dp=d, pp=p) for t in (1, 2) for c in (1, 2) for d in (1, 2, 4) for p in (1, 2)
                 if t * c * d * p <= world]
    out = []
    for s in src_grids:
        for d in dst_grids:
            ns, nd = s["tp"] * s["dp"] * s["pp"], d["tp"] * d["cp"] * d["dp"] * d["pp"]
            B = 2 * max(s["dp"], d["dp"])
            wire = ("fp32", "bf16")[len(out) % 2]
            if ns == nd:
                out.append(case(f"slow c {s}->{d}", lay(**s), lay(**d), B=B, wire=wire))
            if ns + nd <= world:
                out.append(case(f"slow nc {s}->{d}", lay(**s), lay(**d, off=ns), B=B, wire=wire))
                out.append(case(f"slow nc llm-first {s}->{d}", lay(**s, off=nd), lay(**d), B=B, wire=wire))
    return out
