"""Optimizers: AdamW with weight decay on matrices only (fused on CUDA), or Muon for the hidden
matrices with AdamW for everything else, presented to the trainer as one optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tinygpt.core.config import FUSED_PROJ_MUON, ConfigError, TrainConfig

# Muon's learning rate relative to cfg.lr (the trainer sets group["lr"] = lr * lr_scale). With
# adjust_lr_fn="match_rms_adamw" Muon's update has AdamW's RMS (0.2 sqrt(max(A, B)) scaling,
# Moonshot's "Muon is Scalable for LLM Training"), but the small models here still want a larger
# step than AdamW: on Tiny Shakespeare (`benchmarks/muon_vs_adamw.py`, 300 steps) the best Muon
# rate was 2-4x the best AdamW rate, and 4x the AdamW-tuned lr beat 1x and 2x on the "cpu" model.
MUON_LR_SCALE = 4.0
MUON_MOMENTUM = 0.95

# Parameters that look like matrices but are lookup tables or the output head: Muon is for the
# hidden layers (its authors and nanochat / modded-nanogpt keep these on AdamW).
_NOT_HIDDEN = ("embed", "lm_head", "wte", "wpe")

# Polar Express (Amsel et al. 2025, arXiv:2505.16932), five steps with modded-nanogpt's 2% safety
# factor: a tuned (a, b, c) per step instead of Newton-Schulz's one triple
# (`TrainConfig.muon_coeffs`).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The orthogonal factor of G (its polar decomposition's U V^T), approximated in bf16 as
    torch's Newton-Schulz is, with Polar Express's per-step coefficients."""
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + eps)
    for a, b, c in POLAR_EXPRESS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


# NorMuon (Li et al. 2025, arXiv:2510.05491; modded-nanogpt): the decay of each neuron's running
# mean square of the orthogonalised update (`normalize_rows`), AdamW's beta2 of the recipes.
NORMUON_BETA2 = 0.95


def normalize_rows(
    update: torch.Tensor, state: dict, weight: float | torch.Tensor = 1 - NORMUON_BETA2
) -> torch.Tensor:
    """NorMuon's step on an orthogonalised `update` (out x in): each row, one output neuron,
    divided by the root of its running mean square (`state["row_sq"]`, moved by `weight`, 0 on a
    skipped step), then all of it scaled back to the update's Frobenius norm, so that Muon's
    learning rate keeps its meaning (as modded-nanogpt does)."""
    u = update.float()
    mean_sq = u.square().mean(dim=-1, keepdim=True)
    if "row_sq" not in state:
        state["row_sq"] = torch.zeros_like(mean_sq)
    state["row_sq"].lerp_(mean_sq, weight)
    out = u * state["row_sq"].clamp_min(1e-10).rsqrt()
    return out * (u.norm() / out.norm().clamp_min(1e-10))


def _orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    if group.get("coeffs") == "polar-express":
        return polar_express(update)
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(
        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
    )


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (matmuls, embeddings); never norms or biases."""
    seen, decay, no_decay = set(), [], []
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def split_muon_params(
    model: torch.nn.Module,
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(hidden 2-D matrices for Muon, other 2-D weights for AdamW with decay, the rest without). A
    tied embedding / lm_head matrix (met under two names) is counted once, on AdamW; fused
    projections are refused (FUSED_PROJ_MUON)."""
    by_id: dict[int, tuple[torch.nn.Parameter, bool]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            raise ConfigError(FUSED_PROJ_MUON)
        hidden = p.dim() == 2 and not any(k in name for k in _NOT_HIDDEN)
        prev = by_id.get(id(p))
        by_id[id(p)] = (p, hidden and (prev is None or prev[1]))
    muon = [p for p, hidden in by_id.values() if hidden]
    decay = [p for p, hidden in by_id.values() if not hidden and p.dim() >= 2]
    no_decay = [p for p, hidden in by_id.values() if not hidden and p.dim() < 2]
    return muon, decay, no_decay


class EagerOptimizer(torch.optim.Optimizer):
    """torch's Optimizer without the compiler's import, for a process that never compiles. torch
    wraps these methods in `torch._disable_dynamo` (and AdamW's step in
    `_use_grad_for_differentiable`), which imports torch._dynamo on its first call (about 1.5
    CPU-seconds, as much as `import torch`) only to keep the compiler out; these are the wrapped."""

    add_param_group = inspect.unwrap(torch.optim.Optimizer.add_param_group)
    zero_grad = inspect.unwrap(torch.optim.Optimizer.zero_grad)
    state_dict = inspect.unwrap(torch.optim.Optimizer.state_dict)
    load_state_dict = inspect.unwrap(torch.optim.Optimizer.load_state_dict)


def eager(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A torch optimizer class on EagerOptimizer's methods, its step unwrapped and run without grad
    (all `_use_grad_for_differentiable` does with differentiable=False, less its graph breaks)."""
    step = inspect.unwrap(cls.step)

    def eager_step(self, closure=None):
        with torch.no_grad():
            return step(self, closure)

    return type(f"Eager{cls.__name__}", (cls, EagerOptimizer), {"step": eager_step})


EagerAdamW = eager(torch.optim.AdamW)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices, AdamW for the rest, behaving as one optimizer: the groups in
    `param_groups` are the very dicts the two inner optimizers step with, and they share one
    `state`, so the trainer's per-step lr, ``GradScaler.unscale_``, ``clip_grad_norm_`` and the
    state dicts all see a single ordinary optimizer."""

    def __init__(
        self,
        muon_groups: list[dict],
        adamw_groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        momentum: float = MUON_MOMENTUM,
        fused: bool = False,
    ):
        for g in muon_groups:
            g.setdefault("kind", "muon")
        for g in adamw_groups:
            g.setdefault("kind", "adamw")
        groups = [g for g in muon_groups + adamw_groups if len(g["params"]) > 0]
        super().__init__(groups, {})
        # The inner optimizers fill in their defaults (momentum, betas, ...) into the shared dicts.
        self._muon = self.inner_muon(
            [g for g in self.param_groups if g["kind"] == "muon"] or [{"params": []}],
            lr=lr,
            momentum=momentum,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        )
        self._adamw = self.inner_adamw(
            [g for g in self.param_groups if g["kind"] == "adamw"] or [{"params": []}],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=fused,
        )
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this optimizer's group dicts and state."""
        for inner, kind in ((self._muon, "muon"), (self._adamw, "adamw")):
            inner.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            inner.state = self.state

    # torch.amp.GradScaler hands fp16 steps to this optimizer with `grad_scale`
    # (None once unscale_ ran) and `found_inf` (a device tensor) set on it,
    # instead of reading found_inf back to the host to decide whether to step:
    # no host-device sync per step. The step then unscales and skips by itself.
    _step_supports_amp_scaling = True
    inner_muon: type[torch.optim.Optimizer] = torch.optim.Muon
    inner_adamw: type[torch.optim.Optimizer] = torch.optim.AdamW

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        # no GradScaler (bf16, fp32): the inner optimizers as they are
        # Polar Express and NorMuon are this class's own Muon step, not torch's
        own = any(g.get("coeffs") or g.get("normuon") for g in self._muon.param_groups)
        if grad_scale is None and found_inf is None and not own:
            if self._muon.param_groups:
                self._muon.step()
            if self._adamw.param_groups:
                self._adamw.step()
            return loss
        if self._muon.param_groups:
            self._muon_step_scaled(grad_scale, found_inf)
        if self._adamw.param_groups:
            # the fused kernel unscales and skips on found_inf itself
            if all(g.get("fused") for g in self._adamw.param_groups):
                self._adamw.grad_scale, self._adamw.found_inf = grad_scale, found_inf
                try:
                    self._adamw.step()
                finally:
                    del self._adamw.grad_scale, self._adamw.found_inf
            # unfused (the CPU): the sync costs nothing there
            elif found_inf is None or not found_inf.item():
                if grad_scale is not None:
                    for g in self._adamw.param_groups:
                        for p in g["params"]:
                            if p.grad is not None:
                                p.grad.div_(grad_scale.to(p.grad.device))
                self._adamw.step()
        return loss

    def _muon_step_scaled(
        self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
    ) -> None:
        """torch.optim.Muon's update, unscaled by `grad_scale` and made a no-op on the device when
        `found_inf` is set (gradients zeroed, the momentum's, the decay's and the update's weights
        chosen by a device-side `where`), so no value is read back to the host."""
        from torch.optim._muon import _adjust_lr

        for group in self._muon.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                skip = (
                    torch.zeros((), dtype=torch.bool, device=p.device)
                    if found_inf is None
                    else found_inf.to(p.device) > 0
                )
                grad = p.grad if grad_scale is None else p.grad / grad_scale.to(p.device)
                grad = torch.where(skip, 0.0, grad)  # inf * 0 would be nan
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                # the factors in fp32, rounded as torch rounds
                # the Python numbers Muon passes: the same steps
                buf.lerp_(grad, torch.where(skip, 0.0, 1 - momentum))
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = _orthogonalize(update, group)
                if group.get("normuon"):
                    weight = torch.where(skip, 0.0, 1 - NORMUON_BETA2)
                    update = normalize_rows(update, state, weight)
                p.mul_(torch.where(skip, 1.0, 1 - lr * wd))
                keep = torch.where(skip, 0.0, 1.0)
                p.add_(update * keep, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Optimizer.load_state_dict replaces `state` and the group dicts: re-point the inner ones.
        super().load_state_dict(state_dict)
        self._link()


class EagerMuonAdamW(MuonAdamW, EagerOptimizer):
    """MuonAdamW without the compiler's import (EagerOptimizer), inside and out."""

    inner_muon = eager(torch.optim.Muon)
    inner_adamw = EagerAdamW


def rate_groups(
    model: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainConfig
) -> list[dict]:
    """AdamW's decayed matrices as groups: one at lr, or, where `embed_lr_scale` or `head_lr_scale`
    differ from 1, the input embedding and the head (untied; a tied matrix is the embedding) each in
    a `scaled_group` of its own. Default rates keep one group, so checkpoints keep their layout."""
    scales = {"embed": cfg.embed_lr_scale, "lm_head": cfg.head_lr_scale}
    if all(s == 1.0 for s in scales.values()):
        scales = {}
    first_name = {id(p): n for n, p in model.named_parameters()}
    kinds = {key: [p for p in params if key in first_name[id(p)]] for key in scales}
    taken = {id(p) for ps in kinds.values() for p in ps}
    rest = [p for p in params if id(p) not in taken]
    return [
        {"params": rest, "lr": cfg.lr, "lr_scale": 1.0, "weight_decay": cfg.weight_decay},
        *(scaled_group(ps, cfg, scales[k]) for k, ps in kinds.items() if ps),
    ]


def scaled_group(params: list, cfg: TrainConfig, scale: float) -> dict:
    """A group at `scale` times cfg.lr, its weight decay divided by `scale`: lr * weight_decay, the
    decay per step, stays AdamW's."""
    return {
        "params": params,
        "lr": cfg.lr * scale,
        "lr_scale": scale,
        "weight_decay": cfg.weight_decay / scale,
    }


def build_optimizer(
    model: torch.nn.Module,
    cfg: TrainConfig,
    device_type: str,
    *,
    muon_lr_scale: float = MUON_LR_SCALE,
    compiled: bool = True,
) -> torch.optim.Optimizer:
    """The optimizer for `cfg.optimizer` (the trainer sets the rate every step, times each group's
    ``lr_scale``); where nothing is `compiled`, the same steps without importing the compiler."""
    betas = (cfg.beta1, cfg.beta2)
    fused = device_type == "cuda"
    if cfg.optimizer == "adamw":
        groups = param_groups(model, cfg.weight_decay)
        adamw = torch.optim.AdamW if compiled else EagerAdamW
        return adamw(groups, lr=cfg.lr, betas=betas, eps=1e-8, fused=fused)
    if cfg.optimizer == "muon":
        muon, decay, no_decay = split_muon_params(model)
        muon_group = scaled_group(muon, cfg, muon_lr_scale)
        if cfg.muon_coeffs != "newton-schulz":
            muon_group["coeffs"] = cfg.muon_coeffs
        if cfg.normuon:
            muon_group["normuon"] = True
        adamw_groups = [
            *rate_groups(model, decay, cfg),
            {"params": no_decay, "lr": cfg.lr, "lr_scale": 1.0, "weight_decay": 0.0},
        ]
        muon_adamw = MuonAdamW if compiled else EagerMuonAdamW
        return muon_adamw([muon_group], adamw_groups, lr=cfg.lr, betas=betas, fused=fused)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose adamw or muon")
