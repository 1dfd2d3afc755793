"""Views made a batch at a time (vitlab.data.batch_views) against torchvision's per-image transforms: the same
parameters from the same generator state, the same pixels given the same parameters."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vitlab.data.batch_views import BatchedResizedCrop, resized_crops, rrc_params

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
