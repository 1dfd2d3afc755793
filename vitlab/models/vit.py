"""The Vision Transformer (Dosovitskiy et al., 2021), with timm's argument and parameter names.

One image's path through the model::

    (B, C, H, W) --patch_embed--> (B, N, E) --cat CLS, + pos_embed--> (B, 1 + N, E)
      --blocks (pre-norm attention + MLP)--> --norm--> forward_features
      --pool (CLS token or mean of patches)--> --fc_norm, head--> (B, num_classes)

Variants are options: ``norm_layer`` (layernorm | rmsnorm), ``mlp_layer`` (mlp | swiglu | moe),
``score`` (dot | general | additive), ``kernel`` (softmax | streaming | argmax | linear), ``pos_embed``
(learn | sincos | none), ``class_token`` and ``global_pool``.

Running at another image size: ``model.set_input_size(64)`` resamples the learned positional
embedding (bicubic, as timm does) in place, or recomputes the sin-cos one; ``load_state_dict(checkpoint_filter_fn(sd, model))``
loads weights trained at one size into a model built for another.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from ..attention import KernelName, ScoreName
from ..layers import Block, GradCheckpointing, MlpName, NormName, PosEmbedName, checkpointed, create_norm, drop_path_rates, \
    resample_pos_embed, sincos_2d_position_encoding
from .hub import HubMixin

__all__ = ["PatchEmbed", "VisionTransformer", "checkpoint_filter_fn"]


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


class PatchEmbed(nn.Module):
    """Image to patch tokens: a conv with kernel = stride = patch size, ``(B, C, H, W) -> (B, N, E)``."""

    def __init__(self, img_size: int | tuple[int, int], patch_size: int | tuple[int, int], in_chans: int,
                 embed_dim: int) -> None:
        super().__init__()
        self.patch_size = _pair(patch_size)
        self.in_chans = in_chans
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.set_input_size(img_size)

    def set_input_size(self, img_size: int | tuple[int, int]) -> None:
        img_size = _pair(img_size)
        for side, (size, patch) in zip(("height", "width"), zip(img_size, self.patch_size)):
            if size <= 0 or size % patch != 0:
                raise ValueError(
                    f"img_size {img_size} is not divisible by patch_size {self.patch_size} ({side} {size} "
                    f"vs patch {patch}); use an image size that is a multiple of the patch size")
        self.img_size = img_size
        self.grid_size = (img_size[0] // self.patch_size[0], img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    dynamic = False  # any image size that is a multiple of the patch size (the model's dynamic_img_size)

    def forward(self, x: Tensor) -> Tensor:
        expected = (self.in_chans, *self.img_size)
        sizes_ok = tuple(x.shape[1:]) == expected or (
            self.dynamic and x.shape[1] == self.in_chans and not (x.shape[2] % self.patch_size[0])
            and not (x.shape[3] % self.patch_size[1]))
        if x.dim() != 4 or not sizes_ok:
            raise ValueError(
                f"expected an image batch (batch, {expected[0]}, {expected[1]}, {expected[2]}), got "
                f"{tuple(x.shape)}; resize the images, or call model.set_input_size(...) to run at "
                f"another resolution" + (" (any multiple of the patch size)" if self.dynamic else ""))
        return rearrange(self.proj(x), "b e h w -> b (h w) e")  # patches in row-major order


def _check_arguments(embed_dim: int, num_heads: int, global_pool: str, class_token: bool, fc_norm: bool | None,
                     pos_embed: str, distilled: bool) -> None:
    """The :class:`VisionTransformer` arguments that cannot go together, each a ``ValueError`` that says why."""
    if distilled and (global_pool != "token" or not class_token or fc_norm):
        raise ValueError("distilled=True reads the CLS and distillation tokens: it needs class_token=True, "
                         "global_pool='token' and no fc_norm")
    if global_pool not in ("token", "avg"):
        raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
    if not class_token and global_pool == "token":
        raise ValueError("class_token=False leaves no token to pool; set global_pool='avg'")
    if pos_embed not in ("learn", "sincos", "none"):
        raise ValueError(f"unknown pos_embed {pos_embed!r}; expected one of learn, sincos, none")
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; choose num_heads "
            f"among the divisors of embed_dim")


class VisionTransformer(nn.Module, HubMixin, GradCheckpointing):
    """Vision Transformer for image classification.

    Args:
        img_size: Input image size (int or ``(H, W)``); must be a multiple of ``patch_size``.
        patch_size: Patch size (int or ``(h, w)``).
        in_chans: Number of input channels.
        num_classes: Classifier outputs; 0 gives no head (``forward`` returns pooled features).
        embed_dim: Token width; must be divisible by ``num_heads``.
        depth: Number of blocks.
        num_heads: Attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of ``embed_dim``.
        qkv_bias: Bias on the query/key/value projections.
        drop_rate: Dropout on the pooled features before the head.
        pos_drop_rate: Dropout after adding the positional embedding.
        proj_drop_rate: Dropout after the attention projection and in the MLP.
        attn_drop_rate: Dropout on attention weights.
        drop_path_rate: Stochastic depth, rising linearly to this rate at the last block.
        global_pool: ``'token'`` (CLS token) or ``'avg'`` (mean of the patch tokens).
        fc_norm: Apply the final norm after pooling instead of before (timm's ``fc_norm``);
            None means True for ``'avg'`` pooling and False for ``'token'``, as in timm.
        class_token: Prepend a learned CLS token (needs ``global_pool='avg'`` when False).
        pos_embed: ``'learn'`` (a learned table), ``'sincos'`` (fixed 2-D sin-cos over the patch
            grid; the CLS token gets none) or ``'none'``.
        norm_layer: ``'layernorm'`` or ``'rmsnorm'`` (blocks and the final norm).
        norm_eps: Their eps: 1e-6 as timm's and Google's ViT (transformers' ViT and DeiT checkpoints: 1e-12).
        mlp_layer: ``'mlp'``, ``'swiglu'`` or ``'moe'``.
        act_layer: MLP activation (``'gelu'``, ``'silu'``, ``'relu'``); None: GELU for ``mlp``,
            SiLU for ``swiglu``.
        num_experts: Experts of ``mlp_layer='moe'`` (:class:`~vitlab.layers.MoE`).
        moe_top_k: Experts each token is routed to.
        moe_expert_layer: Each expert's kind, ``'mlp'`` or ``'swiglu'``.
        moe_aux_loss_weight: Weight of the load-balancing loss.
        score: Attention score, ``'dot'``, ``'general'`` or ``'additive'``.
        kernel: Attention kernel, ``'softmax'``, ``'streaming'``, ``'argmax'`` or ``'linear'``.
        init_values: LayerScale in every block, starting at this value (DeiT III, CaiT); None: none.
        qk_norm: Normalize each head's queries and keys (with ``norm_layer``), as timm's ``qk_norm``.
        reg_tokens: Register tokens after the CLS token (Darcet et al. 2024), left out of pooling.
        no_embed_class: Positions for the patches only, added before the prefix tokens are joined
            (DeiT III, big_vision); default: the prefix tokens have positions too.
        distilled: A distillation token after the CLS token and its own head (``dist_token``, ``head_dist``:
            DeiT, timm's ``VisionTransformerDistilled``). The logits are the two heads' average, or both
            ``(head, head_dist)`` in training after :meth:`set_distilled_training` (distillation).
        dynamic_img_size: Take images of any size that is a multiple of the patch size, the positions resampled
            to their patch grid on the fly (timm's ``dynamic_img_size``): DINO's small local crops.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        global_pool: Literal["token", "avg"] = "token",
        fc_norm: bool | None = None,
        class_token: bool = True,
        pos_embed: PosEmbedName = "learn",
        norm_layer: NormName = "layernorm",
        mlp_layer: MlpName = "mlp",
        act_layer: Literal["gelu", "silu", "relu"] | None = None,
        num_experts: int = 4,
        moe_top_k: int = 2,
        moe_expert_layer: Literal["mlp", "swiglu"] = "mlp",
        moe_aux_loss_weight: float = 0.01,
        score: ScoreName = "dot",
        kernel: KernelName = "softmax",
        init_values: float | None = None,
        qk_norm: bool = False,
        reg_tokens: int = 0,
        no_embed_class: bool = False,
        distilled: bool = False,
        norm_eps: float = 1e-6,
        dynamic_img_size: bool = False,
    ) -> None:
        # every argument, as given: what save_pretrained writes and set_input_size / reset_classifier update
        config: dict[str, Any] = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        _check_arguments(embed_dim, num_heads, global_pool, class_token, fc_norm, pos_embed, distilled)
        self.config = config
        use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = (1 if class_token else 0) + int(distilled) + reg_tokens
        self.num_reg_tokens = reg_tokens
        self.distilled, self.distilled_training = distilled, False
        self.no_embed_class = no_embed_class
        self.pos_embed_type = pos_embed

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.patch_embed.dynamic = dynamic_img_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        if pos_embed == "learn":  # prefix tokens have a learned position too, as in timm, unless no_embed_class
            self.pos_embed = nn.Parameter(torch.zeros(1, self._embedded_prefix + self.patch_embed.num_patches,
                                                      embed_dim))
        else:  # fixed (a buffer, recomputed, not saved) or none
            self.register_buffer("pos_embed", self._fixed_pos_embed(), persistent=False)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        block_args = dict(norm_layer=norm_layer, mlp_layer=mlp_layer, act=act_layer, num_experts=num_experts,
                          moe_top_k=moe_top_k, moe_expert_layer=moe_expert_layer,
                          moe_aux_loss_weight=moe_aux_loss_weight, score=score, kernel=kernel,
                          init_values=init_values, qk_norm=qk_norm, norm_eps=norm_eps)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, drop_path=rate, **block_args)
            for rate in drop_path_rates(drop_path_rate, depth)
        ])
        self.norm = nn.Identity() if use_fc_norm else create_norm(norm_layer, embed_dim, norm_eps)
        self.fc_norm = create_norm(norm_layer, embed_dim, norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if distilled:
            self.head_dist = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @property
    def _embedded_prefix(self) -> int:
        """The prefix tokens (CLS, registers) that have a position of their own: none with ``no_embed_class``."""
        return 0 if self.no_embed_class else self.num_prefix_tokens

    def _fixed_pos_embed(self) -> Tensor:
        """The sin-cos table ``(1, prefix + N, E)`` (zeros at the prefix tokens), or an empty one for ``'none'``."""
        if self.pos_embed_type == "none":
            return torch.zeros(0)
        grid = sincos_2d_position_encoding(self.patch_embed.grid_size, self.embed_dim)
        return torch.cat([grid.new_zeros(self._embedded_prefix, self.embed_dim), grid])[None]

    def init_weights(self) -> None:
        """timm's default ViT initialisation: truncated normal (std 0.02) for linears and pos_embed,
        then each part's own (a SwiGLU gate starts open, as in timm)."""
        if isinstance(self.pos_embed, nn.Parameter):
            trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.dist_token is not None:
            trunc_normal_(self.dist_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights()

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names that the optimizer should not decay (besides norms and biases)."""
        return {n for n in ("pos_embed", "cls_token", "reg_token", "dist_token")  # timm's VisionTransformer's
                if isinstance(getattr(self, n, None), nn.Parameter)}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's parameter groups by depth (for ``timm.optim.param_groups_layer_decay``): the stem, each
        block, then the final norm with the last."""
        return dict(stem=r"^cls_token|pos_embed|patch_embed|reg_token|dist_token",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        """The head; with a distillation token ``(head, head_dist)``, as timm."""
        return (self.head, self.head_dist) if self.distilled else self.head

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        """In training, return both heads' logits ``(head, head_dist)`` (distillation) instead of their average."""
        self.distilled_training = enable

    def reset_classifier(self, num_classes: int, global_pool: Literal["token", "avg"] | None = None) -> None:
        """A new head for ``num_classes`` classes (0: none), initialised as in :meth:`init_weights`
        (timm's ``reset_classifier``; fine-tuning on another label set starts here)."""
        if global_pool is not None:
            if global_pool not in ("token", "avg") or (global_pool == "token" and self.cls_token is None):
                raise ValueError(f"global_pool={global_pool!r} is not available for this model")
            self.global_pool = self.config["global_pool"] = global_pool
        if self.distilled and global_pool not in (None, "token"):
            raise ValueError("a distilled model reads the CLS and distillation tokens: global_pool='token'")
        device = next(self.parameters()).device
        for name in ("head", "head_dist") if self.distilled else ("head",):
            head = nn.Linear(self.embed_dim, num_classes, device=device) if num_classes > 0 else nn.Identity()
            if num_classes > 0:
                trunc_normal_(head.weight, std=0.02)
                nn.init.zeros_(head.bias)
            setattr(self, name, head)
        self.num_classes = self.config["num_classes"] = num_classes

    def set_input_size(self, img_size: int | tuple[int, int]) -> None:
        """Run at another image size: resample a learned ``pos_embed`` (bicubic) to the new patch grid;
        recompute a sin-cos one."""
        old_grid = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size)
        if isinstance(self.pos_embed, nn.Parameter):
            new_pos = resample_pos_embed(self.pos_embed.data, self.patch_embed.grid_size, old_grid,
                                         self._embedded_prefix)
            self.pos_embed = nn.Parameter(new_pos, requires_grad=self.pos_embed.requires_grad)
        else:
            self.pos_embed = self._fixed_pos_embed().to(self.pos_embed.device)
        self.config["img_size"] = self.patch_embed.img_size

    def _embed(self, x: Tensor) -> Tensor:
        """Patches, then the prefix tokens (CLS, registers) before them and the positions: added after the
        prefix is joined (timm's original ViT, DeiT), or before it with ``no_embed_class`` (DeiT III)."""
        pos = self._positions(x.shape[-2:])
        x = self.patch_embed(x)  # (B, N, E)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token)
                  if t is not None]
        if self.no_embed_class and pos.numel():
            x = x + pos.to(x.dtype)
        if prefix:
            x = torch.cat([*prefix, x], dim=1)  # (B, prefix + N, E)
        if not self.no_embed_class and pos.numel():
            x = x + pos.to(x.dtype)
        return self.pos_drop(x)

    def _positions(self, size: tuple[int, int]) -> Tensor:
        """The positions of an image of ``size`` ``(H, W)``: ``pos_embed``; with ``dynamic_img_size`` at another
        patch grid, resampled to it (a learned table, bicubic, as :meth:`set_input_size` and timm's
        ``dynamic_img_size`` resample it) or recomputed (sin-cos), on every call."""
        grid = (size[0] // self.patch_embed.patch_size[0], size[1] // self.patch_embed.patch_size[1])
        if grid == self.patch_embed.grid_size or not self.patch_embed.dynamic or not self.pos_embed.numel():
            return self.pos_embed
        if isinstance(self.pos_embed, nn.Parameter):
            return resample_pos_embed(self.pos_embed, grid, self.patch_embed.grid_size, self._embedded_prefix)
        table = sincos_2d_position_encoding(grid, self.embed_dim).to(self.pos_embed.device)
        return torch.cat([table.new_zeros(self._embedded_prefix, self.embed_dim), table])[None]

    def forward_features(self, x: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` to normed tokens ``(B, prefix + N, E)``, the CLS token (if any) first."""
        x = self._embed(x)
        for block in self.blocks:
            x = checkpointed(self.grad_checkpointing, block, x)
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Tokens ``(B, prefix + N, E)`` to logits ``(B, num_classes)`` (or pooled ``(B, E)`` if ``pre_logits``);
        with a distillation token, both heads' logits in distilled training (:meth:`set_distilled_training`)."""
        if self.distilled:
            x, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
            if pre_logits:
                return (x + x_dist) / 2
            x, x_dist = self.head(x), self.head_dist(x_dist)
            return (x, x_dist) if self.distilled_training and self.training else (x + x_dist) / 2
        x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        return self.forward_head(self.forward_features(x))

    @torch.no_grad()
    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        """Every block's attention weights for images ``x``: one ``(B, heads, 1 + N, 1 + N)`` per block.

        With a CLS token, index 0 along the last two axes is the CLS token; rows are queries and sum to 1.
        """
        x = self._embed(x)
        maps = []
        for block in self.blocks:
            x, weights = block(x, need_weights=True)
            maps.append(weights)
        return maps


def checkpoint_filter_fn(state_dict: dict[str, Tensor], model: VisionTransformer) -> dict[str, Tensor]:
    """Adapt a ViT state dict to ``model``: resample ``pos_embed`` if the patch grid differs.

    Example: ``model.load_state_dict(checkpoint_filter_fn(torch_or_safetensors_sd, model))``.
    """
    state_dict = dict(state_dict)
    pos = state_dict.get("pos_embed")
    if pos is not None and isinstance(model.pos_embed, nn.Parameter) and pos.shape != model.pos_embed.shape:
        old_n = pos.shape[1] - model._embedded_prefix
        side = int(round(old_n ** 0.5))
        if side * side != old_n:
            raise ValueError(
                f"cannot infer the patch grid of a pos_embed with {old_n} grid positions (not square); "
                f"build the model at the checkpoint's img_size and call model.set_input_size(...) instead")
        state_dict["pos_embed"] = resample_pos_embed(pos, model.patch_embed.grid_size, (side, side),
                                                     model._embedded_prefix)
    return state_dict
