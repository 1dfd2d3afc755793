"""Views made a batch at a time (vitlab.data.batch_views) against torchvision's per-image transforms: the same
pixels given the same parameters, and parameters distributed as torchvision's draws (over 10,000 draws)."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vitlab.data.batch_views import (BatchedColorJitter, BatchedGaussianBlur, BatchedGrayscale, BatchedResizedCrop,
                                     BatchedSolarize, BatchedViews, resized_crops, rrc_boxes)

BICUBIC = v2.InterpolationMode.BICUBIC


def uniforms(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("out", [(32, 32), (16, 16), (24, 40)])
@pytest.mark.parametrize("shape", [(48, 40), (80, 72)])  # weights looked up in a table; made for the batch
def test_each_view_is_torchvisions_resized_crop_of_the_same_box(out, shape):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(64, 3, *shape, generator=g)
    boxes = rrc_boxes(torch.rand(64, 22, generator=g), *shape, (0.02, 1.0), (3 / 4, 4 / 3))
    assert (boxes[:, 2] < out[0]).any() and (boxes[:, 2] > out[0]).any()  # crops grown and shrunk
    views = resized_crops(images, boxes, out)
    for image, (top, left, h, w), view in zip(images, boxes.tolist(), views):
        expected = TF.resized_crop(image, top, left, h, w, list(out), interpolation=BICUBIC, antialias=True)
        torch.testing.assert_close(view, expected, atol=1e-5, rtol=0)


def test_the_batched_crop_and_flip_are_torchvisions_of_the_same_parameters_flipped_half_the_time():
    view = BatchedResizedCrop((32, 32), scale=(0.2, 1.0))
    images = torch.rand(200, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    params = view.params(uniforms(200, view.uniforms), 32, 32)
    assert params.shape == (200, 5) and params.dtype == torch.long
    expected = []
    for image, (top, left, h, w, flipped) in zip(images, params.tolist()):
        crop = TF.resized_crop(image, top, left, h, w, [32, 32], interpolation=BICUBIC, antialias=True)
        expected.append(TF.horizontal_flip(crop) if flipped else crop)
    torch.testing.assert_close(view(images, params), torch.stack(expected), atol=1e-5, rtol=0)
    flips = view.params(uniforms(10_000, 23, seed=2), 32, 32)[:, 4].double().mean()
    assert abs(flips - 0.5) < 0.015  # RandomHorizontalFlip's p
    unflipped = BatchedResizedCrop((32, 32), scale=(0.2, 1.0), hflip=False)
    assert not unflipped.params(uniforms(1000, 23), 32, 32)[:, 4].any()


def test_uint8_images_give_the_views_of_their_float_values_unrounded():
    g = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g)
    view = BatchedResizedCrop((32, 32), scale=(0.2, 1.0), hflip=False)
    params = view.params(torch.rand(8, view.uniforms, generator=g), 32, 32)
    out = view(images, params)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, view(images.float(), params), atol=1e-4, rtol=0)
    assert not torch.equal(out, out.round())  # unrounded: the model sees the filter's values


JITTER_KERNELS = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)


def torchvisions_jitter(image: torch.Tensor, params: list[float]) -> torch.Tensor:
    """``ColorJitter``'s transform of one float image given its parameters (applied, order (4), factors (4)): the
    adjustments in the order, each with its factor, skipping those without one (numbered 4)."""
    if params[0] < 0.5:
        return image
    for fn in map(int, params[1:5]):
        if fn < 4:
            image = JITTER_KERNELS[fn](image, params[5 + fn])
    return image


def torchvisions_view(image: torch.Tensor, params: list[float], size: int, kernel: int = 5) -> torch.Tensor:
    """DINO's view of one float image in [0, 1] (its DataAugmentationDINO, written here from the paper's code) made
    by torchvision's functional ops, given the batched view's parameters: crop (clamped to [0, 1], as a uint8 image's
    is) and flip, jitter, grey, blur, solarization."""
    top, left, h, w, flipped = map(int, params[:5])
    x = TF.resized_crop(image, top, left, h, w, [size, size], interpolation=BICUBIC, antialias=True).clamp(0, 1)
    x = TF.horizontal_flip(x) if flipped else x
    x = torchvisions_jitter(x, params[5:14])
    x = TF.rgb_to_grayscale(x, num_output_channels=3) if params[14] > 0.5 else x
    x = TF.gaussian_blur(x, [kernel, kernel], [params[16], params[16]]) if params[15] > 0.5 else x
    return TF.solarize(x, 128 / 255) if params[17] > 0.5 else x


def dino_batched(size: int, blur_p: float, solarize_p: float, kernel: int = 5) -> BatchedViews:
    return BatchedViews(BatchedResizedCrop((size, size), scale=(0.3, 1.0)), BatchedColorJitter(0.4, 0.4, 0.2, 0.1, 0.8),
                        BatchedGrayscale(0.2), BatchedGaussianBlur(kernel, (0.1, 2.0), blur_p),
                        BatchedSolarize(128 / 255, solarize_p))


@pytest.mark.parametrize("size, blur_p, solarize_p", [(32, 1.0, 0.0), (32, 0.1, 0.2), (16, 0.5, 0.0), (48, 0.5, 0.5)])
def test_dinos_views_made_at_once_are_torchvisions_of_the_same_parameters(size, blur_p, solarize_p):
    # The batch: every crop, flip, jitter (in its random order), grey, blur and solarization made at once; each
    # image: torchvision's functional ops with the same parameters
    n = 256
    images = torch.randint(0, 256, (n, 3, 40, 36), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    batched = dino_batched(size, blur_p, solarize_p)
    assert batched.uniforms == 23 + 9 + 1 + 2 + 1
    params = batched.params(uniforms(n, batched.uniforms), 40, 36)
    assert params.shape == (n, batched.width) and params.dtype == torch.float64
    views = batched(images, params) / 255
    assert views.dtype == torch.float32 and views.shape == (n, 3, size, size)
    jitter, grey, blur, solar = params[:, 5], params[:, 14], params[:, 15], params[:, 17]
    assert 0.7 < jitter.mean() < 0.9 and 0.1 < grey.mean() < 0.3 and abs(blur.mean() - blur_p) < 0.1
    assert abs(solar.mean() - solarize_p) < 0.1
    expected = [torchvisions_view(image.float() / 255, row, size) for image, row in zip(images, params.tolist())]
    torch.testing.assert_close(views, torch.stack(expected), atol=2e-5, rtol=0)


def test_a_jitter_without_some_adjustments_makes_and_applies_only_the_others():
    batched = BatchedColorJitter(0.5, 0, 0, 0.2)
    images = torch.rand(64, 3, 12, 12, generator=torch.Generator().manual_seed(4)) * 1.2 - 0.1  # overshoot kept
    params = batched.params(uniforms(64, batched.uniforms))
    assert (params[:, 0] == 1).all()  # p=1
    assert (params[:, 1:5] == 4).sum(1).eq(2).all() and (params[:, 6:8] == torch.tensor([1.0, 1.0])).all()
    expected = [torchvisions_jitter(image, row) for image, row in zip(images, params.tolist())]
    torch.testing.assert_close(batched(images, params), torch.stack(expected), atol=2e-5, rtol=0)


def test_the_jitters_hue_made_of_its_images_alone_equals_the_whole_batchs_and_torchvisions():
    # On the CPU a round's hue shift is made of the images whose round is hue (found on the host); on the GPU of
    # every image, kept where it applies (no wait for the host). Both ways against torchvision, image by image.
    batched = BatchedColorJitter(0.4, 0.4, 0.2, 0.1, 0.8)
    images = torch.rand(128, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    params = batched.params(uniforms(128, batched.uniforms, seed=5))
    expected = [torchvisions_jitter(image, row) for image, row in zip(images, params.tolist())]
    hue_rounds = (params[:, 0] > 0.5)[:, None] & (params[:, 1:5] == 3)
    assert 10 < hue_rounds[:, 0].sum() < 50 and hue_rounds.any(dim=1).float().mean() > 0.7  # each round has some
    subset, whole = BatchedColorJitter.apply(images, params, subset=True), BatchedColorJitter.apply(images, params,
                                                                                                   subset=False)
    torch.testing.assert_close(subset, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(subset, torch.stack(expected), atol=2e-5, rtol=0)
    torch.testing.assert_close(batched(images, params), subset, atol=0, rtol=0)  # the CPU's way


def test_a_crops_overshoot_below_black_gives_finite_colours():
    # Upscaled stripes of blue over black: the bicubic dips below 0 beside each edge while red stays at 0, where
    # the hue's saturation divides by the brightest channel (0); the loader's uint8 crop is clamped, so is this
    images = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    images[:, 2, :, ::2] = 255
    view = BatchedViews(BatchedResizedCrop((32, 32), scale=(0.02, 0.05)), BatchedColorJitter(0, 0, 0, 0.1))
    views = view(images, view.params(uniforms(64, view.uniforms), 32, 32))
    assert torch.isfinite(views).all() and views.min() >= 0 and views.max() <= 255


def test_each_colour_transforms_parameters_are_distributed_as_torchvisions_draws_over_10000():
    # torchvision's coin (RandomApply, _RandomApplyTransform) and make_params under torch's generator, 10,000 times,
    # against vitlab's parameters of 10,000 images' uniforms: the coins as often, each factor and the blur's sigma
    # (two-sample KS), the jitter's order (every one of the 24, as often: chi-square)
    from scipy.stats import chi2_contingency, ks_2samp

    n, image = 10_000, torch.zeros(3, 8, 8)
    torch.manual_seed(0)
    jitter = v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)
    theirs = [jitter.transforms[0].make_params([image]) for _ in range(n)]
    ours = BatchedColorJitter(0.4, 0.4, 0.2, 0.1, 0.8).params(uniforms(n, 9))
    assert abs(ours[:, 0].mean() - 0.8) < 0.015
    for i, key in enumerate(("brightness_factor", "contrast_factor", "saturation_factor", "hue_factor")):
        assert ks_2samp(ours[:, 5 + i].numpy(), [t[key] for t in theirs]).pvalue > 1e-3, key
    orders = lambda rows: torch.tensor([o[0] * 64 + o[1] * 16 + o[2] * 4 + o[3] for o in rows]).bincount(minlength=256)
    counts = torch.stack((orders(ours[:, 1:5].long().tolist()), orders([t["fn_idx"].tolist() for t in theirs])))
    counts = counts[:, counts.sum(0) > 0]
    assert counts.shape[1] == 24 and chi2_contingency(counts.numpy()).pvalue > 1e-3
    blur = v2.GaussianBlur(5, (0.1, 2.0))
    sigmas = [blur.make_params([image])["sigma"][0] for _ in range(n)]
    ours = BatchedGaussianBlur(5, (0.1, 2.0), 0.5).params(uniforms(n, 2, seed=1))
    assert abs(ours[:, 0].mean() - 0.5) < 0.015 and ks_2samp(ours[:, 1].numpy(), sigmas).pvalue > 1e-3
    for coin in (BatchedGrayscale(0.2), BatchedSolarize(0.5, 0.2)):
        assert abs(coin.params(uniforms(n, 1, seed=2)).mean() - 0.2) < 0.015, type(coin).__name__
