"""Data loading on small generated data: decoding, subsets, transforms, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.data import load_split
from vitlab.data.images import balanced_indices
from vitlab.data.transforms import eval_transform, image_transform, train_transform
from vitlab.errors import DataError


def test_imagefolder_decodes_once_into_uint8_with_sorted_class_labels(tiny_imagefolder):
    data = load_split("imagefolder", tiny_imagefolder, "train")
    assert data.images.shape == (96, 3, 32, 32) and data.images.dtype == torch.uint8
    assert data.classes == ["class_0", "class_1", "class_2"]
    assert data.labels.bincount().tolist() == [32, 32, 32]
    # The colour of each class survives decoding: class c is brightest in channel c.
    for c in range(3):
        assert data.images[data.labels == c].float().mean((0, 2, 3)).argmax() == c


def test_subsets_are_balanced_and_deterministic(tiny_imagefolder):
    data = load_split("imagefolder", tiny_imagefolder, "train", subset=10, seed=3)
    assert data.labels.bincount().tolist() == [4, 3, 3]
    again = load_split("imagefolder", tiny_imagefolder, "train", subset=10, seed=3)
    assert torch.equal(data.images, again.images)


def test_balanced_indices_spread_over_classes():
    labels = torch.arange(10).repeat_interleave(100)
    index = balanced_indices(labels, 55)
    assert labels[index].bincount().tolist() == [6] * 5 + [5] * 5
    assert len(balanced_indices(labels, 0)) == 1000


def test_images_of_another_size_are_resized_at_decode(tmp_path):
    from conftest import make_imagefolder

    make_imagefolder(tmp_path, {"train": 2}, size=40)
    assert load_split("imagefolder", tmp_path, "train", size=(32, 32)).images.shape == (6, 3, 32, 32)


def test_unreadable_image_is_named(tmp_path):
    from conftest import make_imagefolder

    make_imagefolder(tmp_path, {"train": 2})
    bad = tmp_path / "train" / "class_1" / "broken.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DataError, match=f"cannot read image '{bad}'"):
        load_split("imagefolder", tmp_path, "train")


def test_missing_root_and_split_are_named(tmp_path):
    with pytest.raises(DataError, match=r"data\.root='.*nowhere' does not exist"):
        load_split("imagefolder", tmp_path / "nowhere", "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match=r"has no 'test' folder"):
        load_split("imagefolder", tmp_path, "test")
    # An ImageNet-style config (test_split: val) on train/ and test/: the folders found, the key to set, the
    # extensions read (issue 37, 4). It named train/ and test/ as expected and *.png only.
    (tmp_path / "test").mkdir()
    with pytest.raises(DataError) as e:
        load_split("imagefolder", tmp_path, "val")
    assert str(e.value) == (f"data.root={str(tmp_path)!r} has no 'val' folder; its folders: 'test', 'train'. Name "
                            f"the folder of each split with data.train_split and data.test_split (here: "
                            f"data.test_split=test); each holds one folder of images per class "
                            f"(.png, .jpg, .jpeg, .bmp, .webp, .ppm, .tif, .tiff)")
    with pytest.raises(DataError) as e:
        load_split("imagefolder", tmp_path, "test")
    assert str(e.value) == (f"no class folders in {str(tmp_path / 'test')!r}; it should hold one folder of images "
                            f"per class (.png, .jpg, .jpeg, .bmp, .webp, .ppm, .tif, .tiff)")
    with pytest.raises(DataError, match=r"CIFAR-10 not found under data\.root=.*set data\.download=true"):
        load_split("cifar10", tmp_path, "train", download=False)


def test_train_transform_hands_over_uint8_and_a_batch_is_normalized_as_each_image_alone():
    from vitlab.data.transforms import ModelInput, image_transform

    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    out = train_transform((32, 32), crop_padding=4, hflip=True, augment="randaugment")(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8 and type(out) is torch.Tensor
    plain = train_transform((32, 32), crop_padding=0, hflip=False)(image)
    assert torch.equal(plain, image) and torch.equal(eval_transform()(image), image)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    batch = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    got = ModelInput(mean, std)(batch, train=True)  # no erasing without reprob
    # One normalization: a batch in training, an image alone in vitlab predict (image_transform).
    assert torch.equal(got, torch.stack([image_transform((32, 32), mean, std)(x) for x in batch]))
    formula = (batch / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert torch.allclose(got, formula, atol=1e-6)


def test_image_transform_takes_any_pil_image():
    from PIL import Image

    out = image_transform((32, 32))(Image.new("L", (50, 70), color=128))
    assert out.shape == (3, 32, 32)


@pytest.mark.parametrize("mode,suffix", [("RGB", ".png"), ("L", ".png"), ("RGBA", ".png"), ("P", ".png"),
                                         ("RGB", ".bmp"), ("RGB", ".jpg")])
def test_read_image_decodes_as_pil_does(tmp_path, mode, suffix):
    """Every format and colour mode gives PIL's RGB pixels (JPEG: up to decoder rounding)."""
    import numpy as np
    from PIL import Image

    from vitlab.data import read_image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)).convert(mode)
    path = tmp_path / f"image{suffix}"
    image.save(path)
    expected = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    got = read_image(path)
    assert got.dtype == torch.uint8 and got.shape == (3, 20, 28)
    assert (got.int() - expected.int()).abs().max() <= (2 if suffix == ".jpg" else 0)
    # Resizing at decode: PIL's bicubic (what timm's and torchvision's PIL transforms do), to within 1.
    resized = torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((16, 12), Image.BICUBIC)))
    diff = (read_image(path, (12, 16)).int() - resized.permute(2, 0, 1).int()).abs()
    assert diff.max() <= (3 if suffix == ".jpg" else 1)


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_greyscale_of_more_than_8_bits_is_scaled_to_8_bits_not_clipped(tmp_path, mode):
    # A 0..65535 ramp (16-bit PNG, its 32-bit integer form, and floats in 0..1) keeps all 256 levels:
    # round(v / 257), as libvips and ImageMagick scale 16 bits to 8. PIL's convert("RGB") clips at 255.
    import numpy as np
    from PIL import Image

    from vitlab.data import pil_to_tensor, read_image

    ramp = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    expected = torch.from_numpy(np.rint(ramp / 257.0).astype(np.uint8))
    if mode == "I;16":
        Image.fromarray(ramp).save(tmp_path / "ramp.png")  # a 16-bit greyscale PNG
        got = read_image(tmp_path / "ramp.png")
    elif mode == "I":
        got = pil_to_tensor(Image.fromarray(ramp.astype(np.int32), mode="I"))
    else:
        got = pil_to_tensor(Image.fromarray((ramp / 65535.0).astype(np.float32), mode="F"))
    assert got.shape == (3, 256, 256) and torch.equal(got[0], got[2])
    assert torch.equal(got[0], expected) and got.unique().numel() == 256


def test_every_split_is_numbered_by_the_training_splits_classes(tmp_path):
    # A test split without one of the training classes keeps the training numbering; a class only the
    # test split has is one line.
    from conftest import make_imagefolder

    from vitlab.data import index_split

    make_imagefolder(tmp_path, {"train": 2, "test": 2})
    import shutil

    shutil.rmtree(tmp_path / "test" / "class_0")
    train = index_split("imagefolder", tmp_path, "train")
    test = load_split("imagefolder", tmp_path, "test", classes=train.classes)
    assert test.classes == ["class_0", "class_1", "class_2"] and test.labels.tolist() == [1, 1, 2, 2]
    # class_2's images still look like class 2 (brightest in channel 2): labels and pixels stay together
    assert test.images[test.labels == 2].float().mean((0, 2, 3)).argmax() == 2
    (tmp_path / "test" / "class_9").mkdir()
    shutil.copy(next((tmp_path / "test" / "class_1").iterdir()), tmp_path / "test" / "class_9" / "x.png")
    with pytest.raises(DataError, match=r"split 'test' of data.root=.* has class\(es\) \['class_9'\] that the "
                                        r"training split does not have") as e:
        index_split("imagefolder", tmp_path, "test", classes=train.classes)
    assert "\n" not in str(e.value)


def test_decoded_images_fill_one_preallocated_tensor_in_order(tiny_imagefolder):
    from vitlab.data import index_split, read_image
    from vitlab.data.decode import decode_all

    index = index_split("imagefolder", tiny_imagefolder, "test")
    files = sorted((tiny_imagefolder / "test").rglob("*.png"))
    got = decode_all(lambda i: index.decode(i, None), [5, 0, 17])
    assert torch.equal(got, torch.stack([read_image(files[i]) for i in (5, 0, 17)]))


@pytest.mark.parametrize("seed", range(4))
def test_precision_recall_f1_and_balanced_accuracy_are_scikit_learns(seed):
    # Uneven: class 5 never occurs nor is predicted (scikit-learn leaves it out of the averages), class 4 is
    # never predicted (precision 0 by zero_division=0), a rare class 3.
    from sklearn.metrics import balanced_accuracy_score, precision_recall_fscore_support

    from vitlab.tasks.classification import metrics_from_predictions

    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.randint(0, 3, (200,), generator=g), torch.tensor([3, 3, 4, 4, 4])])
    logits = torch.randn(len(labels), 6, generator=g) + 2.5 * F.one_hot(labels, 6)
    logits[:, 4:] = -10.0  # 4 and 5 never predicted
    m = metrics_from_predictions(logits, labels, 6)
    y, p = labels.numpy(), logits.argmax(1).numpy()
    present = sorted(set(y) | set(p))
    per_class = precision_recall_fscore_support(y, p, labels=present, average=None, zero_division=0)
    for name, values in zip(("precision", "recall", "f1"), per_class[:3]):
        assert [m[name][k] for k in present] == pytest.approx(values.tolist(), abs=1e-12)
    for average in ("macro", "weighted"):
        expected = precision_recall_fscore_support(y, p, average=average, zero_division=0)
        got = [m[f"{average}_{name}"] for name in ("precision", "recall", "f1")]
        assert got == pytest.approx(list(expected[:3]), abs=1e-12), average
    assert m["balanced_top1"] == pytest.approx(balanced_accuracy_score(y, p), abs=1e-12)
    assert m["f1"][5] == 0.0 and m["precision"][4] == 0.0
