"""Peers of mok_nn in the benchmark, one implementation per process (the protocol of the benchmark, mok_nn/bench.py).

    python -m mok_nn.bench --peers sonicmoe,liger,hf [--layer] ...     (the usual entry point: runs this module
                                                                         once per peer, in a subprocess)
    python -m mok_nn.bench_peers --impl NAME --shapes ... --tokens ... --out FILE.json [--layer] [--site DIR]
    python -m mok_nn.bench_peers --impl NAME --import-only              (does NAME import here? versions)

NAME is one of PEERS (below) or `package.module:Class` (a Peer subclass importable in the child: how tests
register a fake peer). Every process builds the same problem with mok_nn.bench.make_problem (same seed: the
same x, router, weights, dy and top-k(softmax) routing, bit for bit on the same GPU), so the peers run on
mok_nn's problem without sharing a process with it or with each other: SonicMoE / QuACK bring their own CuTe
DSL (4.7.1) where mok_nn's kernels are built with 4.8.1, and `--site` puts the peers' install dir (pip
--target) first on the path of this process only.

Per shape, in this order:
1. warm-up on the timed problem (QuACK's and Liger's autotuners tune at the size they first see, so at the
   benchmark size, not at the check size);
2. correctness against a float32 reference of the routed experts, expert by expert (`reference_check`), on a
   `--check-tokens` problem with the same weights: the forward output and every gradient (x, routing weights,
   gate_up, down), relative L2 errors below `--check-tol` (2e-2; bf16 peers measure 3e-3 to 6e-3 on the H200).
   A peer that fails is rejected: it is NOT timed, its record says why (`skipped`);
3. peak memory of one forward+backward above the inputs and parameters, and the memory the forward keeps
   for the backward (`mok_nn.bench.measure_calls`, CUDA only), then the timed iterations (the same
   function the in-process implementations are timed with: no-grad forward, forward+backward with the
   gradients reset to None, medians, bwd = fwd+bwd - fwd).

`--layer` adds the whole block of each peer with its own router ("<impl>_layer" records): SonicMoE's full
layer (moe_TC_softmax_topk_layer: its router GEMM, its top-k(softmax)+renormalise kernel and that kernel's
backward), Liger behind a torch router (F.linear, fp32 softmax, top-k, renormalise), transformers'
Qwen3MoeSparseMoeBlock. The router weight is a leaf (its gradient is computed), and its forward is checked
against the float32 reference experts under the routing its own router picked (`Peer.routing`; a router whose
logits are bf16 picks other experts than the float32 one for near-ties: a line says for what share of the
tokens).

Records: the schema of mok_nn.bench (BENCHMARKS.md keys, plus act_mem_gb), plus `check` (the relative
errors), `timed` (what the timed region holds) and `versions`. A peer that cannot run (not importable,
needs CUDA, dtype not supported, check failed, crashed, ran past the time limit) gets a record per shape
with the timing fields null and `skipped` saying why, and a line `skip <impl> ...` on stdout: the JSON of a
run says by itself which peers were measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

DEFAULT_SITE = "/tmp/site/site-packages"
CHECK_TOL = 2e-2  # routed experts, every output and gradient vs the fp32 reference
LAYER_CHECK_TOL = 2e-2  # whole layer, forward output, under the routing the layer picked
TIMING_KEYS = ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "peak_mem_gb", "act_mem_gb")


# --------------------------------------------------------------------------
# environment


def setup_peer_site(site: str) -> list[str]:
    """Put the peers' install dir (pip --target) first on sys.path and PYTHONPATH (QuACK's compile workers are
    child processes). pip --target does not run .pth files, and the CuTe DSL's .pth is what puts its `cutlass`
    package dir on the path, so that dir is added explicitly. The dir must contain 'site-packages' in its path:
    quack 0.6 treats code elsewhere as its own and its gated GEMMs then fail to import."""
    paths = []
    for sub in ("nvidia_cutlass_dsl/dsl_packages", "nvidia_cutlass_dsl/python_packages"):  # DSL 4.5+ / 4.4
        if os.path.isdir(os.path.join(site, sub)):
            paths.append(os.path.join(site, sub))
    paths.append(site)
    for p in reversed(paths):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + old)
    if f"{os.sep}site-packages" not in site:
        print(f"WARNING: {site} has no 'site-packages' in its path: quack 0.6 fingerprints CuTe DSL functions as "
              "its own code there and its gated GEMMs fail to import", flush=True)
    return paths


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "triton", "transformers", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl",
                 "nvidia-cutlass-dsl-libs-cu13", "liger-kernel", "apache-tvm-ffi", "cuda-bindings"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------
# the peers: each maps mok's weight layout to its own once (untimed) and runs the routed experts / the layer


def torch_router(x, router_w, top_k):
    """The routing of make_problem in torch: logits in x's dtype, fp32 softmax, top-k, renormalised."""
    import torch
    import torch.nn.functional as F

    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


class Peer:
    """One implementation of the routed experts (and of the whole layer). __init__ imports it: an exception
    there (ImportError, or any other) makes the run a skip, with the exception as the reason."""

    name = "?"  # the records' impl ("<name>_layer" for the whole layer)
    needs_cuda = False
    uses_site = False  # imports from the peers' install dir (--site)
    dtypes = ("bf16", "fp32")
    timed = ""  # what the timed region of the routed experts holds
    timed_layer = "torch router (F.linear, fp32 softmax, top-k, renormalise) + the routed experts"

    def __init__(self, shape: str, device: str, dtype):
        self.shape, self.device, self.dtype = shape, device, dtype

    def weights(self, gate_up, down):  # mok layout -> this impl's layout; untimed
        return gate_up, down

    def grads_to_mok(self, d_gate_up, d_down):  # this impl's layout -> mok's (for the check); d[e] is enough
        return d_gate_up, d_down

    def ids(self, ids):  # the routing ids in the dtype the impl takes; untimed
        return ids

    def experts(self, x, ids, w, gate_up, down):
        raise NotImplementedError

    def routing(self, x, router_w, top_k):
        """(ids, w): the routing the layer's own router picks (what the layer check takes)."""
        return torch_router(x, router_w, top_k)

    def layer(self, x, router_w, gate_up, down, top_k):
        ids, w = self.routing(x, router_w, top_k)
        return self.experts(x, self.ids(ids), w, gate_up, down)


def _hf_config(shape: str):
    """A Qwen3-MoE config of this shape (every benchmark shape is SwiGLU experts over [E, 2I, H] / [E, H, I]
    weights with a softmax top-k router; Qwen3's block is the closest transformers block to each), with
    transformers' default experts implementation, grouped_mm."""
    import transformers

    from .bench import SHAPES

    hidden, inter, num_experts, top_k = SHAPES[shape]
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                         num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    config._experts_implementation = "grouped_mm"  # what from_pretrained / from_config pick by default
    return config


class HfPeer(Peer):
    """transformers' default experts (Qwen3MoeExperts, grouped_mm) and block (Qwen3MoeSparseMoeBlock), built on
    the meta device: the benchmark's leaves are put in place of their parameters (bench.bind_params), the routing
    as the experts' top-k arguments. The same code is the in-process "hf_default" row of `--backend torch`."""

    name = "hf_default"
    timed = "transformers Qwen3MoeExperts, default experts implementation (grouped_mm), routing given"
    timed_layer = ("transformers Qwen3MoeSparseMoeBlock: its router (F.linear, fp32 softmax, top-k, renormalise) + "
                   "experts")

    def __init__(self, shape, device, dtype):
        super().__init__(shape, device, dtype)
        import torch
        from .bench import bind_params
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

        self.bind = bind_params
        with torch.device("meta"):
            self.experts_module = Qwen3MoeExperts(_hf_config(shape))
            self.block = Qwen3MoeSparseMoeBlock(_hf_config(shape))

    def experts(self, x, ids, w, gate_up, down):
        return self.bind(self.experts_module, {"gate_up_proj": gate_up, "down_proj": down})(x, ids, w.to(x.dtype))

    def routing(self, x, router_w, top_k):
        _logits, w, ids = self.bind(self.block.gate, {"weight": router_w})(x)  # w in x's dtype, as the block
        return ids, w

    def layer(self, x, router_w, gate_up, down, top_k):
        params = {"gate.weight": router_w, "experts.gate_up_proj": gate_up, "experts.down_proj": down}
        return self.bind(self.block, params)(x.view(1, *x.shape)).view(x.shape)


def _interleave(gate_up):
    """(E, 2I, H) [gate; up] rows -> (E, 2I, H) [g0, u0, g1, u1, ...] rows (SonicMoE's default layout)."""
    e, i2, h = gate_up.shape
    return gate_up.view(e, 2, i2 // 2, h).transpose(1, 2).reshape(e, i2, h).contiguous()


class _Deinterleaved:
    """gate_up[e] in mok's [gate; up] layout from an interleaved (E, 2I, H) tensor, one expert at a time (no
    full copy: at deepseek-v3 the whole gradient is 15 GB)."""

    def __init__(self, gate_up):
        e, i2, h = gate_up.shape
        self.t = gate_up.view(e, i2 // 2, 2, h).transpose(1, 2)

    def __getitem__(self, e):
        return self.t[e].reshape(-1, self.t.shape[-1])


class SonicPeer(Peer):
    """SonicMoE 0.1.2.post1 (QuACK grouped GEMMs). Routed experts: its fixed-top-k layer from after the router
    (TC_topk_router_metadata_triton -> _UpProjection -> _DownProjection); layer: moe_TC_softmax_topk_layer.
    w1 = (2I, H, E) view of (E, 2I, H) rows interleaved [g0, u0, ...] (its default layout), w2 =
    down.permute(1, 2, 0), ids int32; the training forward (it stores the pre-activation), like mok's."""

    name = "sonicmoe"
    needs_cuda = True
    uses_site = True
    dtypes = ("bf16",)
    timed = ("SonicMoE fixed-top-k path after its router: TC_topk_router_metadata_triton + _UpProjection (QuACK "
             "gemm_gated) + _DownProjection (QuACK gemm + Triton weighted gather-sum)")
    timed_layer = "SonicMoE moe_TC_softmax_topk_layer: its router GEMM, top-k(softmax)+renormalise kernel, experts"

    def __init__(self, shape, device, dtype):
        super().__init__(shape, device, dtype)
        import importlib.util

        import torch
        from sonicmoe.enums import ActivationType

        if importlib.util.find_spec("quack.epilogue") is not None:  # quack >= 0.6: its gated GEMMs import this at
            import quack.epilogue.library  # noqa: F401               first call; fail here, before any GPU work
        from sonicmoe.functional import _DownProjection, _UpProjection, moe_TC_softmax_topk_layer
        from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton

        self.torch = torch
        self.act = ActivationType.SWIGLU
        self.Up, self.Down, self.layer_fn = _UpProjection, _DownProjection, moe_TC_softmax_topk_layer
        self.meta = TC_topk_router_metadata_triton

    def weights(self, gate_up, down):
        return _interleave(gate_up), down

    def grads_to_mok(self, d_gate_up, d_down):
        return _Deinterleaved(d_gate_up), d_down

    def ids(self, ids):
        return ids.to(self.torch.int32).contiguous()

    @staticmethod
    def _w(gate_up, down):
        return gate_up.permute(1, 2, 0), down.permute(1, 2, 0)  # (2I, H, E), (H, I, E)

    def experts(self, x, ids, w, gate_up, down):
        torch = self.torch
        w1, w2 = self._w(gate_up, down)
        T, K = ids.shape
        TK, E, dev = T * K, w2.shape[-1], x.device
        s_scatter_idx = torch.empty(TK, dtype=torch.int32, device=dev)
        s_reverse_scatter_idx = torch.empty(TK, dtype=torch.int32, device=dev)
        expert_frequency = torch.empty(E, dtype=torch.int32, device=dev)
        expert_frequency_offset = torch.empty(E + 1, dtype=torch.int32, device=dev)
        x_gather_idx = torch.empty(TK, dtype=torch.int32, device=dev)
        self.meta(ids, E, expert_frequency, expert_frequency_offset, x_gather_idx, s_scatter_idx, s_reverse_scatter_idx)
        a, h = self.Up.apply(x, w1, None, expert_frequency_offset, TK, K, x_gather_idx, s_scatter_idx,
                             s_reverse_scatter_idx, None, False, self.act, False, False)
        return self.Down.apply(a, h, w2, None, w, expert_frequency_offset, T, K, x_gather_idx, s_scatter_idx,
                               s_reverse_scatter_idx, None, False, self.act)

    def layer(self, x, router_w, gate_up, down, top_k):
        w1, w2 = self._w(gate_up, down)
        y, _logits, _freq = self.layer_fn(x, router_w, w1, None, w2, None, top_k,
                                          self.torch.cuda.current_stream().cuda_stream, self.act, False,
                                          is_softmax_over_topk=False, norm_topk_probs=True, concat_layout=False)
        return y


class LigerPeer(Peer):
    """Liger-Kernel 0.8.5 fused MoE (Triton): LigerFusedMoEFunction(x, gate_up, down, ids int32, weights) in mok's
    weight layout; one device->host sync (.item()) inside its forward (its design); backward recomputes."""

    name = "liger"
    needs_cuda = True
    uses_site = True
    timed = ("liger_kernel LigerFusedMoEFunction (Triton): routing metadata + one .item() host sync, fused "
             "gather/up-proj/SwiGLU, down-proj, weighted gather-sum")

    def __init__(self, shape, device, dtype):
        super().__init__(shape, device, dtype)
        import torch
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        self.torch = torch
        self.fn = LigerFusedMoEFunction

    def ids(self, ids):
        return ids.to(self.torch.int32).contiguous()

    def experts(self, x, ids, w, gate_up, down):
        return self.fn.apply(x, gate_up, down, ids, w)


PEERS = {"sonicmoe": SonicPeer, "liger": LigerPeer, "hf": HfPeer}


def resolve(spec: str) -> type:
    """A Peer class from a PEERS name or `package.module:Class`."""
    if spec in PEERS:
        return PEERS[spec]
    mod, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"unknown peer {spec!r}: one of {', '.join(PEERS)}, or package.module:Class")
    return getattr(importlib.import_module(mod), attr)


# --------------------------------------------------------------------------
# correctness: float32 reference of the routed experts, expert by expert (no fp32 copy of all the weights)


def check_problem(p: dict, tokens: int, seed: int = 1) -> dict:
    """A problem of `tokens` tokens on p's weights and router: new x and dy, routing as make_problem does it."""
    import torch

    device, dt = p["x"].device, p["x"].dtype
    g = torch.Generator(device=device).manual_seed(seed)
    hidden, top_k = p["x"].shape[1], p["ids"].shape[1]
    x = torch.randn(tokens, hidden, device=device, generator=g).to(dt)
    w, ids = torch.topk(torch.softmax(x.float() @ p["router"].T, dim=-1), top_k, dim=-1)
    dy = torch.randn(tokens, hidden, device=device, generator=g).to(dt)
    return dict(p, x=x, ids=ids, w=w / w.sum(-1, keepdim=True), dy=dy)


def reference_check(cp, y, dx=None, dw=None, d_gate_up=None, d_down=None) -> dict:
    """Relative L2 errors against a float32 reference on problem cp: of y only where dx is None, else of y, dx,
    dw (routing weights), d_gate_up and d_down (mok's layout; d[e] is all that is read; None: frozen weights,
    not checked)."""
    import torch
    import torch.nn.functional as F

    from .bench import rel_l2

    need_grads = dx is not None
    x, ids, w, gu, dn, dy = cp["x"], cp["ids"], cp["w"], cp["gate_up_proj"], cp["down_proj"], cp["dy"]
    y_ref = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    dx_ref = torch.zeros_like(y_ref)
    dw_ref = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    num = {"d_gate_up": 0.0, "d_down": 0.0}
    den = {"d_gate_up": 0.0, "d_down": 0.0}
    for e in range(gu.shape[0]):
        t_idx, j_idx = (ids == e).nonzero(as_tuple=True)
        gue = gu[e].float().requires_grad_(need_grads)
        dne = dn[e].float().requires_grad_(need_grads)
        if t_idx.numel() == 0:
            if need_grads:  # an idle expert: its gradients must be zero (or absent)
                for k, g in (("d_gate_up", d_gate_up), ("d_down", d_down)):
                    if g is not None:
                        num[k] += g[e].float().pow(2).sum().item()
            continue
        with torch.enable_grad():
            xe = x[t_idx].float().requires_grad_(need_grads)
            we = w[t_idx, j_idx].float().requires_grad_(need_grads)
            gate, up = (xe @ gue.T).chunk(2, dim=-1)
            contrib = ((F.silu(gate) * up) @ dne.T) * we[:, None]
            y_ref.index_add_(0, t_idx, contrib.detach())
            if need_grads:
                (contrib * dy[t_idx].float()).sum().backward()
        if need_grads:
            dx_ref.index_add_(0, t_idx, xe.grad)
            dw_ref[t_idx, j_idx] = we.grad
            for k, ref, got in (("d_gate_up", gue.grad, d_gate_up), ("d_down", dne.grad, d_down)):
                if got is None:  # frozen weights: no gradient to check
                    continue
                num[k] += (got[e].float() - ref).pow(2).sum().item()
                den[k] += ref.pow(2).sum().item()
    errs = {"y": rel_l2(y.reshape(y_ref.shape), y_ref)}
    if need_grads:
        errs["dx"] = rel_l2(dx, dx_ref)
        errs["dw"] = rel_l2(dw, dw_ref)
        for k, g in (("d_gate_up", d_gate_up), ("d_down", d_down)):
            if g is not None:
                errs[k] = (num[k] / max(den[k], 1e-30)) ** 0.5
    return errs


def reference_layer_check(cp, y, router_w, routing=None) -> tuple[dict, float]:
    """({"y": rel L2}, rerouted) of a whole layer's output against the float32 reference layer: fp32 logits of
    (x, router_w) as stored, softmax, top-k, renormalised, then the float32 routed experts. routing: the (ids, w)
    the layer's own router picked on cp["x"]; the reference experts then take that routing (a router with bf16
    logits picks other experts for near-ties, which moves y by several percent), and rerouted is the share of
    the tokens whose experts differ from the float32 router's (0.0 where routing is None)."""
    import torch

    probs = torch.softmax(cp["x"].float() @ router_w.float().T, dim=-1)
    w, ids = torch.topk(probs, cp["ids"].shape[1], dim=-1)
    w = w / w.sum(-1, keepdim=True)
    rerouted = 0.0
    if routing is not None:
        r_ids, r_w = routing
        rerouted = (r_ids.long().sort(-1).values != ids.sort(-1).values).any(-1).float().mean().item()
        ids, w = r_ids.long(), r_w.float()
    return reference_check(dict(cp, ids=ids, w=w), y), rerouted


def check_experts(fn, cp, gate_up, down, to_mok=lambda a, b: (a, b)) -> dict:
    """Forward + backward of fn(x, ids, w, gate_up, down) on the check problem, against the float32 reference.
    gate_up / down: leaves in the impl's layout holding cp's weights (their .grad is cleared before and after)."""
    gate_up.grad = down.grad = None
    x = cp["x"].detach().clone().requires_grad_(True)
    w = cp["w"].detach().clone().requires_grad_(True)
    y = fn(x, cp["ids"], w, gate_up, down)
    y.backward(cp["dy"])
    d_gu, d_dn = to_mok(gate_up.grad, down.grad)
    errs = reference_check(cp, y.detach(), x.grad, w.grad, d_gu, d_dn)
    gate_up.grad = down.grad = None
    return errs


def _leaf(t):
    """t as a fresh leaf (on t's storage where t is the problem's own tensor: no 22.5 GB copy at deepseek-v3)."""
    return t.detach().requires_grad_(True)


def _failed(errs, tol):
    return {k: v for k, v in errs.items() if not v < tol}


# --------------------------------------------------------------------------
# one peer, in this process


def run_peer(spec, shapes, tokens, device, dtype="bf16", iters=20, warmup=3, check_tokens=1024, layer=False,
             commit=None, seed=0, out=None, check_tol=CHECK_TOL):
    """Records of one peer over shapes (routed experts, and with layer=True the whole layer); out: a JSON file
    rewritten after every record (a time limit keeps what is done)."""
    import torch

    from . import bench

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = commit or bench._commit()
    dt = bench.DTYPES[dtype]
    ver = versions()
    records = []
    cls = resolve(spec)

    def emit(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if out:
            pathlib.Path(out).write_text(json.dumps(records, indent=1) + "\n")

    def base(shape, impl):
        return dict(shape=shape, ep=1, tokens_per_rank=tokens, impl=impl, precision=dtype,
                    **{k: None for k in TIMING_KEYS}, gpu=gpu, torch=torch.__version__, commit=commit, date=date)

    def skip(shape, impl, reason):
        print(f"skip {impl} {shape}: {reason}", flush=True)
        emit(dict(base(shape, impl), skipped=reason, versions=ver))

    modes = [("experts", cls.name)] + ([("layer", cls.name + "_layer")] if layer else [])
    for shape in shapes:
        hidden, inter, _, top_k = bench.SHAPES[shape]
        flops = 6 * tokens * top_k * hidden * inter
        reason = peer = None
        try:
            peer = cls(shape, device, dt)  # imports the peer (no GPU work)
        except Exception as e:  # ImportError or anything else its import raises
            reason = f"not importable: {type(e).__name__}: {e}"[:600]
        if reason is None and cls.needs_cuda and device != "cuda":
            reason = "needs a CUDA device"
        elif reason is None and dtype not in cls.dtypes:
            reason = f"dtype {dtype} not supported (only {', '.join(cls.dtypes)})"
        if reason:
            for _, impl in modes:
                skip(shape, impl, reason)
            continue
        p = bench.make_problem(shape, tokens, device, seed=seed, dtype=dt)
        cp = check_problem(p, min(check_tokens, tokens), seed=seed + 1) if check_tokens else None
        for mode, impl in modes:
            t0 = time.time()
            try:
                errs, bad, timing = _one_mode(peer, mode, p, cp, dt, device, iters, warmup, check_tol)
            except Exception as e:  # one failing shape or mode must not lose the others
                import traceback

                traceback.print_exc()
                skip(shape, impl, f"error: {type(e).__name__}: {e}"[:2000])
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            if errs is not None:
                print(f"{shape} {impl}: rel L2 vs the fp32 reference (T={cp['x'].shape[0]}) "
                      + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
            if bad:
                skip(shape, impl, f"check failed (not timed): rel L2 above {bad.pop('tol')}: "
                     + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()))
                records[-1]["check"] = _rounded(errs)
                continue
            f_ms, fb_ms, peak, act = timing
            rec = dict(base(shape, impl), **bench.timing_fields(flops, f_ms, fb_ms - f_ms, peak, act),
                       check=None if errs is None else _rounded(errs),
                       timed=peer.timed if mode == "experts" else peer.timed_layer, versions=ver,
                       wall_s=round(time.time() - t0, 1))
            emit(rec)
        del p, cp
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


def _one_mode(peer, mode, p, cp, dt, device, iters, warmup, check_tol):
    """(errors, failed errors with their "tol" or {}, (fwd ms, fwd+bwd ms, peak GB, act GB) or None) of one peer
    in one mode ("experts": routing given; "layer": its own router) on problem p; warm-up, check on cp (None:
    no check), then the measurement only where the check passed. The leaves (the weights in the peer's layout:
    copies of p's, 22.5 GB at deepseek-v3) live in this frame only, so two modes never hold two copies."""
    import torch

    from . import bench

    top_k = p["ids"].shape[1]
    gu, dn = peer.weights(p["gate_up_proj"], p["down_proj"])
    gu, dn = _leaf(gu), _leaf(dn)
    x = p["x"].detach().clone().requires_grad_(True)
    if mode == "experts":
        ids = peer.ids(p["ids"])  # outside the timed region
        w = p["w"].detach().clone().requires_grad_(True)
        leaves = [x, w, gu, dn]

        def call():
            return peer.experts(x, ids, w, gu, dn)

    else:
        rw = p["router"].to(dt, copy=True).requires_grad_(True)
        leaves = [x, rw, gu, dn]

        def call():
            return peer.layer(x, rw, gu, dn, top_k)

    bench.warm_up(call, leaves, p["dy"], warmup)
    errs, bad = None, {}
    if cp is not None:
        if mode == "experts":
            errs = check_experts(lambda x_, i_, w_, a_, b_: peer.experts(x_, peer.ids(i_), w_, a_, b_), cp, gu, dn,
                                 peer.grads_to_mok)
            tol = check_tol
        else:
            rw_c = p["router"].to(dt)
            with torch.no_grad():
                y = peer.layer(cp["x"], rw_c, gu, dn, top_k)
                routing = peer.routing(cp["x"], rw_c, top_k)
            errs, rerouted = reference_layer_check(cp, y, rw_c, routing)
            print(f"{peer.name}_layer: its router picks other experts than the fp32 router for {rerouted:.2%} of "
                  "the tokens; checked under its own routing", flush=True)
            del y, routing
            tol = LAYER_CHECK_TOL
        bad = _failed(errs, tol)
        if bad:
            return errs, dict(bad, tol=tol), None
    name = "experts" if mode == "experts" else "layer"
    return errs, {}, bench.measure_calls({name: call}, leaves, p["dy"], device, iters, 1)[name]


def _rounded(errs):
    return {k: float(f"{v:.3e}") for k, v in errs.items()}


# --------------------------------------------------------------------------
# the peers, each in a subprocess (what `python -m mok_nn.bench --peers` calls)


def _checkout_root() -> str:
    return str(pathlib.Path(__file__).resolve().parents[1])


def run_subprocesses(peers, shapes, tokens, device, dtype="bf16", iters=20, warmup=3, check_tokens=1024,
                     layer=False, commit=None, site=None, timeout=600, seed=0, budget=None):
    """Each peer in `python -m mok_nn.bench_peers --impl NAME` (its own process: its own DSL, its own CUDA
    context), one after the other; their records. timeout: seconds per peer process; budget: seconds for all of
    them (each gets at most what is left; one that would get under 30 s is not started). A shape or mode a peer
    did not report (crash, time limit) gets a skipped record naming the exit status."""
    import torch

    from . import bench

    records = []
    end = None if budget is None else time.monotonic() + budget
    for spec in peers:
        cls = resolve(spec)
        limit = timeout if end is None else min(timeout, int(end - time.monotonic()))
        with tempfile.TemporaryDirectory(prefix="mok_peer_") as tmp:
            out = os.path.join(tmp, "records.json")
            cmd = [sys.executable, "-m", "mok_nn.bench_peers", "--impl", spec, "--shapes", ",".join(shapes),
                   "--tokens", str(tokens), "--device", device, "--dtype", dtype, "--iters", str(iters),
                   "--warmup", str(warmup), "--check-tokens", str(check_tokens), "--seed", str(seed), "--out", out]
            cmd += ["--commit", commit] if commit else []
            cmd += ["--site", site] if site else []
            cmd += ["--layer"] if layer else []
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            path = [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q]
            env["PYTHONPATH"] = os.pathsep.join([_checkout_root()] + path)  # this mok_nn, wherever it was started
            if limit < 30:
                rc = f"not started: {max(limit, 0)} s left of the peers' budget"
                got = []
                print(f"=== peer {spec}: {rc}", flush=True)
            else:
                rc, got = _run_one(cmd, env, out, spec, limit)
        have = {(r["shape"], r["impl"]) for r in got}
        gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for shape in shapes:
            for impl in [cls.name] + ([cls.name + "_layer"] if layer else []):
                if (shape, impl) not in have:
                    reason = f"no record from its process (exit {rc})"
                    print(f"skip {impl} {shape}: {reason}", flush=True)
                    got.append(dict(shape=shape, ep=1, tokens_per_rank=tokens, impl=impl, precision=dtype,
                                    **{k: None for k in TIMING_KEYS}, gpu=gpu, torch=torch.__version__,
                                    commit=commit or bench._commit(), date=date, skipped=reason))
        records += got
    return records


def _run_one(cmd, env, out, spec, limit):
    """(exit status or why it stopped, records) of one peer's process, killed with its process group past limit s."""
    print(f"=== peer {spec} (own process, limit {limit} s): {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    # its own process group (setsid), so that killpg also ends its compile workers
    proc = subprocess.Popen(cmd, env=env, preexec_fn=os.setsid)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = f"killed after the {limit} s limit"
    got = json.loads(pathlib.Path(out).read_text()) if os.path.exists(out) else []
    print(f"=== peer {spec}: exit {rc}, {len(got)} record(s) in {time.time() - t0:.0f} s", flush=True)
    return rc, got


def main(argv=None):
    ap = argparse.ArgumentParser(description="one peer of mok_nn's benchmark, in this process (see the module doc)")
    ap.add_argument("--impl", required=True, help=f"one of {', '.join(PEERS)}, or package.module:Class")
    ap.add_argument("--shapes", default=None, help="comma-separated; default as mok_nn.bench")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=1024, help="tokens of the correctness check (0: none)")
    ap.add_argument("--layer", action="store_true", help="also the whole layer, with the peer's own router")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--site", default=DEFAULT_SITE,
                    help="the peers' install dir (pip --target; a path with 'site-packages'), first on the path of "
                         "peers that need it; default %(default)s where it exists")
    ap.add_argument("--out", default=None, help="JSON list of the records, rewritten after each one")
    ap.add_argument("--import-only", action="store_true", help="import the peer, print versions, exit 0 / 1")
    args = ap.parse_args(argv)

    cls = resolve(args.impl)
    if cls.uses_site:
        if os.path.isdir(args.site):
            setup_peer_site(args.site)
        else:
            print(f"note: peers' site {args.site} not found; importing {args.impl} from the normal path", flush=True)
    import torch

    from . import bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.import_only:
        try:
            cls(args.shapes.split(",")[0] if args.shapes else "tiny", device, bench.DTYPES[args.dtype])
        except Exception as e:
            print(json.dumps(dict(impl=cls.name, import_ok=False, error=f"{type(e).__name__}: {e}"[:600],
                                  versions=versions())), flush=True)
            return 1
        mods = {m: os.path.dirname(getattr(sys.modules[m], "__file__", "") or "")
                for m in ("cutlass", "quack", "sonicmoe", "liger_kernel", "transformers") if m in sys.modules}
        print(json.dumps(dict(impl=cls.name, import_ok=True, versions=versions(), modules=mods)), flush=True)
        return 0
    tokens = args.tokens if args.tokens is not None else (8192 if device == "cuda" else 64)
    default = "qwen3-30b-a3b,mixtral-8x7b,deepseek-v3" if device == "cuda" else "tiny"
    shapes = [s for s in (args.shapes or default).split(",") if s]
    for s in shapes:
        if s not in bench.SHAPES:
            ap.error(f"unknown shape {s}; known: {', '.join(bench.SHAPES)}")
    print(f"peer {args.impl} ({cls.name}) on {device}; versions {json.dumps(versions())}", flush=True)
    records = run_peer(args.impl, shapes, tokens, device, args.dtype, args.iters, args.warmup, args.check_tokens,
                       args.layer, args.commit, args.seed, args.out)
    return 0 if all("error:" not in (r.get("skipped") or "") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
