"""Views made a batch at a time (vitlab.data.batch_views) against torchvision's per-image transforms: the same
parameters from the same generator state, the same pixels given the same parameters."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vitlab.data.batch_views import (BatchedColorJitter, BatchedGaussianBlur, BatchedGrayscale, BatchedResizedCrop,
                                     BatchedSolarize, BatchedViews, resized_crops, rrc_params)

BICUBIC = v2.InterpolationMode.BICUBIC


@pytest.mark.parametrize("shape, scale, ratio", [((32, 32), (0.2, 1.0), (3 / 4, 4 / 3)),
                                                 ((37, 23), (0.08, 1.0), (3 / 4, 4 / 3)),
                                                 ((32, 32), (0.05, 0.4), (0.2, 5.0))])  # tries that fail: the fallback
def test_the_boxes_are_torchvisions_draws_from_the_same_generator_state(shape, scale, ratio):
    reference = v2.RandomResizedCrop(16, scale=scale, ratio=ratio)
    image = torch.empty(3, *shape)
    for seed in range(2000):
        torch.manual_seed(seed)
        p = reference.make_params([image])
        assert rrc_params(torch.Generator().manual_seed(seed), *shape, scale, ratio) == (
            p["top"], p["left"], p["height"], p["width"]), seed


@pytest.mark.parametrize("out", [(32, 32), (16, 16), (24, 40)])
@pytest.mark.parametrize("shape", [(48, 40), (80, 72)])  # weights looked up in a table; made for the batch
def test_each_view_is_torchvisions_resized_crop_of_the_same_box(out, shape):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(64, 3, *shape, generator=g)
    boxes = torch.tensor([rrc_params(g, *shape, (0.02, 1.0), (3 / 4, 4 / 3)) for _ in range(64)])
    assert (boxes[:, 2] < out[0]).any() and (boxes[:, 2] > out[0]).any()  # crops grown and shrunk
    views = resized_crops(images, boxes, out)
    for image, (top, left, h, w), view in zip(images, boxes.tolist(), views):
        expected = TF.resized_crop(image, top, left, h, w, list(out), interpolation=BICUBIC, antialias=True)
        torch.testing.assert_close(view, expected, atol=1e-5, rtol=0)


def test_the_batched_view_is_torchvisions_crop_and_flip_drawn_from_the_image_generator():
    # torchvision's per-image view under torch's generator seeded s; the batched one from a generator seeded s
    reference = v2.Compose([v2.RandomResizedCrop(32, scale=(0.2, 1.0), interpolation=BICUBIC, antialias=True),
                            v2.RandomHorizontalFlip()])
    view = BatchedResizedCrop((32, 32), scale=(0.2, 1.0))
    images = torch.rand(200, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    params = torch.stack([view.draw(torch.Generator().manual_seed(s), 32, 32) for s in range(200)])
    expected = []
    for s, image in enumerate(images):
        torch.manual_seed(s)
        expected.append(reference(image))
    assert 60 < int(params[:, 4].sum()) < 140  # flipped and not
    torch.testing.assert_close(view(images, params), torch.stack(expected), atol=1e-5, rtol=0)


def test_uint8_images_give_the_views_of_their_float_values_unrounded():
    g = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g)
    view = BatchedResizedCrop((32, 32), scale=(0.2, 1.0), hflip=False)
    params = torch.stack([view.draw(g, 32, 32) for _ in range(8)])
    out = view(images, params)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, view(images.float(), params), atol=1e-4, rtol=0)
    assert not torch.equal(out, out.round())  # unrounded: the model sees the filter's values


def clamp01(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(0, 1)


def dino_reference(size: int, blur_p: float, solarize_p: float, kernel: int = 5) -> v2.Compose:
    """DINO's view (its DataAugmentationDINO, written here from the paper's code) for float images in [0, 1]."""
    return v2.Compose([  # the crop clamped to [0, 1], as a uint8 image's is
        v2.RandomResizedCrop(size, scale=(0.3, 1.0), interpolation=BICUBIC, antialias=True), v2.Lambda(clamp01),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=blur_p),
        v2.RandomSolarize(128 / 255, p=solarize_p)])


def dino_batched(size: int, blur_p: float, solarize_p: float, kernel: int = 5) -> BatchedViews:
    return BatchedViews(BatchedResizedCrop((size, size), scale=(0.3, 1.0)), BatchedColorJitter(0.4, 0.4, 0.2, 0.1, 0.8),
                        BatchedGrayscale(0.2), BatchedGaussianBlur(kernel, (0.1, 2.0), blur_p),
                        BatchedSolarize(128 / 255, solarize_p))


@pytest.mark.parametrize("size, blur_p, solarize_p", [(32, 1.0, 0.0), (32, 0.1, 0.2), (16, 0.5, 0.0), (48, 0.5, 0.5)])
def test_dinos_views_made_at_once_are_torchvisions_drawn_from_the_image_generator(size, blur_p, solarize_p):
    # Each image: torchvision's Compose under torch's generator seeded s; the batch: parameters drawn from a
    # generator seeded s, every crop, flip, jitter (in its random order), grey, blur and solarization made at once
    n = 256
    images = torch.randint(0, 256, (n, 3, 40, 36), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    reference, batched = dino_reference(size, blur_p, solarize_p), dino_batched(size, blur_p, solarize_p)
    params = torch.stack([batched.draw(torch.Generator().manual_seed(s), 40, 36) for s in range(n)])
    assert params.shape == (n, batched.width)
    expected = []
    for s, image in enumerate(images):
        torch.manual_seed(s)
        expected.append(reference(image.float() / 255))
    views = batched(images, params) / 255
    assert views.dtype == torch.float32 and views.shape == (n, 3, size, size)
    jitter, grey, blur, solar = params[:, 5], params[:, 14], params[:, 15], params[:, 17]
    assert 0.7 < jitter.mean() < 0.9 and 0.1 < grey.mean() < 0.3 and abs(blur.mean() - blur_p) < 0.1
    assert abs(solar.mean() - solarize_p) < 0.1
    orders = {tuple(o) for o in params[jitter > 0, 6:10].long().tolist()}
    assert len(orders) == 24  # every order of the four adjustments
    torch.testing.assert_close(views, torch.stack(expected), atol=2e-5, rtol=0)


def test_a_jitter_without_some_adjustments_draws_and_applies_only_the_others():
    reference = v2.RandomApply([v2.ColorJitter(brightness=0.5, hue=0.2)], p=1.0)  # p=1: its coin drawn all the same
    batched = BatchedColorJitter(0.5, 0, 0, 0.2)
    images = torch.rand(64, 3, 12, 12, generator=torch.Generator().manual_seed(4)) * 1.2 - 0.1  # overshoot kept
    params = torch.tensor([batched.draw(torch.Generator().manual_seed(s)) for s in range(64)])
    expected = []
    for s, image in enumerate(images):
        torch.manual_seed(s)
        expected.append(reference(image))
    torch.testing.assert_close(batched(images, params), torch.stack(expected), atol=2e-5, rtol=0)


def test_the_jitters_hue_made_of_its_images_alone_equals_the_whole_batchs_and_torchvisions():
    # On the CPU a round's hue shift is made of the images whose round is hue (found on the host); on the GPU of
    # every image, kept where it applies (no wait for the host). Both ways against torchvision, image by image.
    batched = BatchedColorJitter(0.4, 0.4, 0.2, 0.1, 0.8)
    reference = v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)
    images = torch.rand(128, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    params = torch.tensor([batched.draw(torch.Generator().manual_seed(s)) for s in range(128)])
    expected = []
    for s, image in enumerate(images):
        torch.manual_seed(s)
        expected.append(reference(image))
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
    params = torch.stack([view.draw(torch.Generator().manual_seed(s), 32, 32) for s in range(64)])
    views = view(images, params)
    assert torch.isfinite(views).all() and views.min() >= 0 and views.max() <= 255


def test_each_colour_transforms_draws_are_torchvisions_from_the_same_generator_state_over_10000_seeds():
    # The same draws, not only the same statistics: torchvision's coin (RandomApply, _RandomApplyTransform) and
    # make_params under torch's generator seeded s; vitlab's from a generator of its own seeded s
    image = torch.zeros(3, 8, 8)
    cases = [
        (BatchedColorJitter(0.4, 0.4, 0.2, 0.1, 0.8), v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
         lambda t: t.transforms[0].make_params([image]),
         lambda p: [float(p["fn_idx"][i]) for i in range(4)] + [p[k] for k in (
             "brightness_factor", "contrast_factor", "saturation_factor", "hue_factor")]),
        (BatchedGaussianBlur(5, (0.1, 2.0), 0.5), v2.RandomApply([v2.GaussianBlur(5, (0.1, 2.0))], p=0.5),
         lambda t: t.transforms[0].make_params([image]), lambda p: [p["sigma"][0]]),
        (BatchedGrayscale(0.2), v2.RandomGrayscale(0.2), None, None),
        (BatchedSolarize(0.5, 0.2), v2.RandomSolarize(0.5, p=0.2), None, None),
    ]
    for ours, theirs, make_params, values in cases:
        applied = 0
        for seed in range(10_000):
            torch.default_generator.manual_seed(seed)  # torch.manual_seed's CPU part (the rest seeds accelerators)
            coin = torch.rand(1).item() < theirs.p  # the coin both draw first
            expected = [float(coin)] + (values(make_params(theirs)) if coin and make_params else [])
            got = ours.draw(torch.Generator().manual_seed(seed))
            assert got[:len(expected)] == expected, (type(ours).__name__, seed)
            applied += coin
        assert abs(applied / 10_000 - theirs.p) < 0.015, type(ours).__name__
