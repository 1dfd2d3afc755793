"""Masked autoencoders (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners"): a ViT encoder that
sees a random quarter of each image's patches, a light decoder on the same attention core that fills in the rest,
and the loss of the pixels it filled in.

- The encoder is vitlab's :class:`~vitlab.models.VisionTransformer` (no head), run on the visible patches only;
  each image keeps its own random patches: the argsort of uniform noise, the first ``1 - mask_ratio`` of them.
- The decoder embeds the encoder's tokens, puts a learned mask token in every hidden patch's place, adds fixed
  2-D sin-cos positions, runs a few :class:`~vitlab.layers.Block` s and predicts each patch's pixels.
- The loss is the mean squared error over the hidden patches, of the pixels normalized within each patch
  (``norm_pix_loss``, MAE's default) or not.

Both position tables are MAE's fixed sin-cos (not trained), kept in the weights so that a checkpoint converted
from transformers' ``ViTMAEForPreTraining`` (:func:`vitlab.interop.from_transformers`) gives its numbers. Called
as transformers' is: ``mae(images, noise=noise)`` gives the loss, the predicted patches and the mask.
"""
from __future__ import annotations

import math

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..layers import Block, GradCheckpointing, checkpointed
from ..layers.pos_embed import sincos_2d_position_encoding
from .hub import HubMixin
from .vit import VisionTransformer

__all__ = ["MaskedAutoencoder", "MAEOutput", "patchify", "unpatchify"]


class MAEOutput(NamedTuple):
    """What a masked autoencoder gives for a batch ``(B, C, H, W)``: the ``loss`` (a scalar), the predicted
    pixels of every patch ``pred`` ``(B, N, p * p * C)``, the ``mask`` ``(B, N)`` (1: hidden, 0: seen) and
    ``ids_restore`` ``(B, N)`` (the patches' order before the shuffle)."""

    loss: Tensor
    pred: Tensor
    mask: Tensor
    ids_restore: Tensor


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Images ``(B, C, H, W)`` as patches ``(B, N, p * p * C)``, row-major patches, each ``(p, p, C)`` flattened
    (MAE's and transformers' order)."""
    b, c, h, w = images.shape
    p = patch_size
    x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(patches: Tensor, patch_size: int, grid: tuple[int, int], channels: int = 3) -> Tensor:
    """The inverse of :func:`patchify`: patches ``(B, N, p * p * C)`` of a ``grid`` ``(h, w)`` as images."""
    b, p = patches.shape[0], patch_size
    x = patches.reshape(b, grid[0], grid[1], p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, grid[0] * p, grid[1] * p)


def _check_arguments(embed_dim: int, decoder_embed_dim: int, decoder_num_heads: int, mask_ratio: float) -> None:
    """The arguments a masked autoencoder cannot take, each a ``ValueError`` that says why."""
    if not 0 < mask_ratio < 1:
        raise ValueError(f"mask_ratio={mask_ratio} must be in (0, 1): the share of each image's patches hidden "
                         f"from the encoder (MAE: 0.75)")
    if decoder_embed_dim > embed_dim:
        raise ValueError(f"decoder_embed_dim={decoder_embed_dim} is wider than the encoder's embed_dim={embed_dim}: "
                         f"MAE's decoder is the light half of the pair (ViT-B's 768 with a 512 decoder); make it at "
                         f"most {embed_dim}")
    if decoder_embed_dim % decoder_num_heads or decoder_embed_dim % 4:
        raise ValueError(f"decoder_embed_dim={decoder_embed_dim} must be divisible by decoder_num_heads="
                         f"{decoder_num_heads} and by 4 (its 2-D sin-cos positions)")


class MaskedAutoencoder(nn.Module, HubMixin, GradCheckpointing):
    """A masked autoencoder: a :class:`VisionTransformer` encoder (``self.encoder``, no head) and MAE's decoder.

    Args:
        img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio, qkv_bias, drop_path_rate, norm_eps:
            The encoder's, as :class:`VisionTransformer`'s (a CLS token, fixed sin-cos positions); ``qkv_bias``
            and ``norm_eps`` the decoder's too.
        decoder_embed_dim, decoder_depth, decoder_num_heads, decoder_mlp_ratio: The decoder's width, blocks, heads
            and MLP ratio (at most the encoder's width).
        mask_ratio: The share of each image's patches hidden from the encoder, in (0, 1).
        norm_pix_loss: The loss of each patch's pixels normalized by their mean and standard deviation (MAE's).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        decoder_mlp_ratio: float = 4.0,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = True,
        norm_eps: float = 1e-6,
    ) -> None:
        config: dict[str, Any] = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        _check_arguments(embed_dim, decoder_embed_dim, decoder_num_heads, mask_ratio)
        self.config = config
        self.mask_ratio, self.norm_pix_loss, self.patch_size, self.in_chans = mask_ratio, norm_pix_loss, patch_size, \
            in_chans
        self.encoder = VisionTransformer(img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=0,
                                         embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                                         qkv_bias=qkv_bias, drop_path_rate=drop_path_rate, norm_eps=norm_eps)
        grid = self.encoder.patch_embed.grid_size
        patches = grid[0] * grid[1]
        if int(patches * (1 - mask_ratio)) < 1:
            largest = math.floor((1 - 1 / patches) * 10**4) / 10**4
            raise ValueError(f"mask_ratio={mask_ratio} leaves none of an image's {patches} patches visible to the "
                             f"encoder; at most {largest} (one patch seen) (mae.mask_ratio)")
        self.encoder.pos_embed.requires_grad_(False)  # fixed sin-cos, written by init_weights
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, 1 + grid[0] * grid[1], decoder_embed_dim),
                                              requires_grad=False)
        self.decoder_blocks = nn.ModuleList([
            Block(decoder_embed_dim, decoder_num_heads, decoder_mlp_ratio, qkv_bias=qkv_bias, norm_eps=norm_eps)
            for _ in range(decoder_depth)])
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=norm_eps)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size * patch_size * in_chans)
        self.init_weights()

    @property
    def patch_embed(self) -> nn.Module:
        """The encoder's patch embedding (what the model's input size is read from)."""
        return self.encoder.patch_embed

    def init_weights(self) -> None:
        """MAE's initialisation: the fixed sin-cos positions, Xavier-uniform linears (and patch embedding, as a
        linear), zero biases, the CLS and mask tokens normal (std 0.02), norms at one and zero."""
        grid, enc, dec = self.encoder.patch_embed.grid_size, self.encoder, self.decoder_embed.out_features
        with torch.no_grad():
            for table, width in ((enc.pos_embed, enc.embed_dim), (self.decoder_pos_embed, dec)):
                positions = sincos_2d_position_encoding(grid, width, layout="mae")
                table.copy_(torch.cat([positions.new_zeros(1, width), positions])[None])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        proj = enc.patch_embed.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        nn.init.normal_(enc.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    def random_masking(self, tokens: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Each image's visible tokens ``(B, keep, E)`` (the ``int(N * (1 - mask_ratio))`` of the lowest ``noise``
        ``(B, N)``, uniform when not given), the mask ``(B, N)`` (1: hidden) and the order that undoes the
        shuffle ``(B, N)``."""
        b, n, e = tokens.shape
        keep = int(n * (1 - self.mask_ratio))
        noise = torch.rand(b, n, device=tokens.device) if noise is None else noise.to(tokens.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        visible = torch.gather(tokens, 1, ids_shuffle[:, :keep, None].expand(-1, -1, e))
        mask = torch.ones(b, n, device=tokens.device)
        mask[:, :keep] = 0
        return visible, torch.gather(mask, 1, ids_restore), ids_restore

    def forward_encoder(self, images: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The encoder on each image's visible patches: normed tokens ``(B, 1 + keep, E)`` (the CLS token first),
        the mask and the restoring order (:meth:`random_masking`)."""
        enc = self.encoder
        x = enc.patch_embed(images) + enc.pos_embed[:, 1:].to(images.dtype)
        x, mask, ids_restore = self.random_masking(x, noise)
        cls = (enc.cls_token + enc.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls.to(x.dtype), x], dim=1)
        for block in enc.blocks:
            x = checkpointed(self.grad_checkpointing, block, x)
        return enc.norm(x), mask, ids_restore

    def forward_decoder(self, latent: Tensor, ids_restore: Tensor) -> Tensor:
        """Every patch's predicted pixels ``(B, N, p * p * C)`` from the encoder's tokens: a mask token in each
        hidden patch's place, the patches back in their order, the decoder's positions and blocks."""
        x = self.decoder_embed(latent)
        b, n = ids_restore.shape
        filled = torch.cat([x[:, 1:], self.mask_token.to(x.dtype).expand(b, n + 1 - x.shape[1], -1)], dim=1)
        filled = torch.gather(filled, 1, ids_restore[..., None].expand(-1, -1, x.shape[2]))
        x = torch.cat([x[:, :1], filled], dim=1) + self.decoder_pos_embed.to(x.dtype)
        for block in self.decoder_blocks:
            x = checkpointed(self.grad_checkpointing, block, x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]

    def loss(self, images: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
        """The mean over the hidden patches of each patch's mean squared error, against its pixels normalized by
        their mean and (unbiased) variance when ``norm_pix_loss`` (MAE's ``forward_loss``)."""
        target = patchify(images, self.patch_size)
        if self.norm_pix_loss:
            target = (target - target.mean(dim=-1, keepdim=True)) / (target.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
        per_patch = ((pred.float() - target.float()) ** 2).mean(dim=-1)
        return (per_patch * mask).sum() / mask.sum()

    def forward(self, images: Tensor, noise: Tensor | None = None) -> MAEOutput:
        """Normalized images ``(B, C, H, W)`` (and the masking ``noise`` ``(B, N)``) to :class:`MAEOutput`."""
        latent, mask, ids_restore = self.forward_encoder(images, noise)
        pred = self.forward_decoder(latent, ids_restore)
        return MAEOutput(self.loss(images, pred, mask), pred, mask, ids_restore)

    def reconstruct(self, images: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Images the model filled in ``(B, C, H, W)`` (the seen patches as given, the hidden ones predicted, in
        the input's normalization: a ``norm_pix_loss`` prediction given back each patch's own mean and spread), and
        the images with their hidden patches zeroed, for a picture."""
        with torch.no_grad():
            out = self(images, noise)
            target = patchify(images, self.patch_size)
            pred = out.pred.float()
            if self.norm_pix_loss:
                pred = pred * (target.var(dim=-1, keepdim=True) + 1e-6) ** 0.5 + target.mean(dim=-1, keepdim=True)
            hidden = out.mask[..., None]
            grid = self.encoder.patch_embed.grid_size
            filled = unpatchify(target * (1 - hidden) + pred * hidden, self.patch_size, grid, self.in_chans)
            masked = unpatchify(target * (1 - hidden), self.patch_size, grid, self.in_chans)
        return filled, masked

    def backbone(self) -> VisionTransformer:
        """The encoder as a :class:`VisionTransformer` without a head (its weights, not a copy), carrying the
        model's ``pretrained_cfg``: what fine-tuning starts from and what k-NN reads the features of."""
        self.encoder.pretrained_cfg = dict(getattr(self, "pretrained_cfg", {}) or {})
        return self.encoder
