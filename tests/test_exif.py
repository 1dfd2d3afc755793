"""Photos upright (issue 37, 2): a JPEG's EXIF orientation tag is applied wherever an image is decoded
(folders, Hugging Face data, shards, predict), as ``PIL.ImageOps.exif_transpose`` and Hugging Face
``datasets`` apply it; ``data.exif_transpose=false`` keeps the stored pixels."""
from __future__ import annotations

import io
from pathlib import Path

import matplotlib.cbook
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

from conftest import reset_accelerate
from vitlab.config import load_config
from vitlab.data.decode import decode_image, open_image, pil_to_tensor
from vitlab.data.shards import decode_sample
from vitlab.data.sources import index_split
from vitlab.training import train

ORIENTATION = 0x0112  # EXIF's Orientation tag: 1 upright, 2-8 the seven flips and quarter turns


def _photo() -> Image.Image:
    """A real photograph (matplotlib's Grace Hopper, a 512 x 600 JPEG)."""
    return Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB")


def _jpeg(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


def _upright(data: bytes) -> torch.Tensor:
    """The reference: PIL's decode, turned by PIL's own exif_transpose."""
    return pil_to_tensor(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_orientation_tag_decodes_to_the_pixels_of_pil_exif_transpose(orientation, tmp_path):
    data = _jpeg(_photo().crop((100, 150, 220, 230)), orientation)  # 120 x 80, landscape as stored
    stored = pil_to_tensor(Image.open(io.BytesIO(data)))
    assert stored.shape == (3, 80, 120)
    expected = _upright(data)
    assert expected.shape == ((3, 120, 80) if orientation >= 5 else (3, 80, 120))  # 5-8 turn it a quarter
    assert torch.equal(decode_image(data, "x"), expected)  # libjpeg-turbo's path
    (tmp_path / "p.jpg").write_bytes(data)
    assert torch.equal(pil_to_tensor(open_image(tmp_path / "p.jpg")), expected)  # PIL's path (predict)
    resized = pil_to_tensor(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).resize((32, 48), Image.BICUBIC))
    assert torch.equal(decode_image(data, "x", (48, 32)), resized)  # turned, then resized
    assert torch.equal(decode_sample({"jpg": data, "__key__": "k"}), expected)  # a shard's sample
    # Off: the stored pixels, as timm's loader reads them.
    assert torch.equal(decode_image(data, "x", exif_transpose=False), stored)
    assert torch.equal(pil_to_tensor(open_image(tmp_path / "p.jpg", exif_transpose=False)), stored)
    if orientation != 1:  # the tag changed something: the shape (5-8) or the pixels (2-4)
        assert expected.shape != stored.shape or not torch.equal(expected, stored)


@pytest.fixture(scope="module")
def photo_copies(tmp_path_factory) -> dict[str, Path]:
    """Two classes of real-photo JPEGs carrying every orientation tag, as an ImageFolder and as the
    Hugging Face DatasetDict of the same files."""
    datasets = pytest.importorskip("datasets", reason="the hf extra is not installed: pip install 'vitlab[hf]'")
    root = tmp_path_factory.mktemp("exif")
    photo = _photo()
    columns = {}
    for split, n in (("train", 16), ("test", 8)):
        columns[split] = {"image": [], "label": []}
        for label, name in enumerate(["face", "tie"]):
            (root / "folder" / split / name).mkdir(parents=True)
            for i in range(n):
                top = 120 + 4 * i if name == "face" else 380 + 4 * i
                f = root / "folder" / split / name / f"{i:02d}.jpg"
                f.write_bytes(_jpeg(photo.crop((150 + 3 * i, top, 246 + 3 * i, top + 64)), 1 + i % 8))
                columns[split]["image"].append(str(f))
                columns[split]["label"].append(label)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["face", "tie"])})
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict(c, features=features) for s, c in columns.items()})
    dd.save_to_disk(str(root / "saved"))
    return {"imagefolder": root / "folder", "hf": root / "saved"}


@pytest.mark.parametrize("exif_transpose", [True, False])
def test_a_folder_and_its_hugging_face_data_set_give_the_same_pixels(photo_copies, exif_transpose):
    folder = index_split("imagefolder", photo_copies["imagefolder"], "train", exif_transpose=exif_transpose)
    hf = index_split("hf", str(photo_copies["hf"]), "train", exif_transpose=exif_transpose)
    for i in range(len(folder)):
        data = folder.encoded(i)
        expected = _upright(data) if exif_transpose else pil_to_tensor(Image.open(io.BytesIO(data)))
        for index in (folder, hf):
            assert torch.equal(index.decode(i, None), expected)  # libjpeg-turbo
            assert torch.equal(pil_to_tensor(index.open(i)), expected)  # PIL
            assert torch.equal(index.decode(i, (32, 32)), pil_to_tensor(index.open(i), (32, 32)))
    portrait = folder.decode(5, None)  # tag 6: stored 96 x 64, shown 64 wide and 96 high
    assert portrait.shape == ((3, 96, 64) if exif_transpose else (3, 64, 96))


def _run(data: list[str], run_dir: Path) -> dict:
    overrides = ["model.name=vit_cifar_tiny_patch4_32", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
                 "data.num_workers=0", "train.batch_size=8", "train.epochs=2", "optim.warmup_epochs=1",
                 "data.loader=torch", f"train.output_dir={run_dir}", *data]
    summary = train(load_config(None, overrides))
    reset_accelerate()
    return summary


def test_a_folder_and_its_hugging_face_data_set_train_to_the_same_numbers(photo_copies, tmp_path, on_cpu):
    folder = _run(["data.dataset=imagefolder", f"data.root={photo_copies['imagefolder']}"], tmp_path / "folder")
    hf = _run(["data.dataset=hf", f"data.root={photo_copies['hf']}"], tmp_path / "hf")
    assert hf["test_top1"] == folder["test_top1"] and hf["test_loss"] == folder["test_loss"]
    a = load_file(str(tmp_path / "folder/checkpoints/last/model.safetensors"))
    b = load_file(str(tmp_path / "hf/checkpoints/last/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Off, the folder trains on other pixels: other weights (the key reaches the decoding).
    _run(["data.dataset=imagefolder", f"data.root={photo_copies['imagefolder']}", "data.exif_transpose=false"],
         tmp_path / "off")
    c = load_file(str(tmp_path / "off/checkpoints/last/model.safetensors"))
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_predict_reads_a_photo_as_its_model_was_trained_upright_or_not(photo_copies, tmp_path, capsys, on_cpu):
    from vitlab.checkpoint import load_model
    from vitlab.cli import main
    from vitlab.data.transforms import decode_upright

    photo = photo_copies["imagefolder"] / "test/face/05.jpg"  # tag 6: a quarter turn
    upright = tmp_path / "upright.png"  # the same pixels turned by PIL, saved losslessly without a tag
    ImageOps.exif_transpose(Image.open(photo)).save(upright)
    stored = tmp_path / "stored.png"
    Image.open(photo).save(stored)
    for key, same_as in ((True, upright), (False, stored)):
        run = tmp_path / f"run_{key}"
        _run(["data.dataset=imagefolder", f"data.root={photo_copies['imagefolder']}", "train.epochs=1",
              f"data.exif_transpose={str(key).lower()}"], run)
        assert decode_upright(load_model(run)) is key  # kept in the checkpoint
        main(["predict", "--checkpoint", str(run), str(photo), str(same_as)])
        lines = capsys.readouterr().out.splitlines()[-2:]
        assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1], lines


def _tiff(entries: list[tuple[int, int, int, bytes]], order: str) -> bytes:
    """A TIFF header and IFD0 of ``(tag, type, count, value)`` entries, ``order`` 'little' or 'big'."""
    head = (b"II*\0" if order == "little" else b"MM\0*") + (8).to_bytes(4, order)
    body = len(entries).to_bytes(2, order)
    for tag, kind, count, value in entries:
        body += tag.to_bytes(2, order) + kind.to_bytes(2, order) + count.to_bytes(4, order) + value.ljust(4, b"\0")
    return head + body + (0).to_bytes(4, order)


def _with_segments(segments: list[bytes]) -> bytes:
    """A real photo's JPEG with ``segments`` (APP1 payloads) put after its SOI marker."""
    out = io.BytesIO()
    _photo().crop((0, 0, 48, 32)).save(out, "JPEG", quality=90)
    data = out.getvalue()
    app1 = b"".join(b"\xff\xe1" + (len(s) + 2).to_bytes(2, "big") + s for s in segments)
    return data[:2] + app1 + data[2:]


def _short(value: int, order: str) -> bytes:
    return value.to_bytes(2, order)


_XMP = b"http://ns.adobe.com/xap/1.0/\x00"
_ORIENTATION_CASES = {
    **{f"tag {v}, {order}-endian": [b"Exif\0\0" + _tiff([(0x010F, 2, 4, b"cam\0"), (ORIENTATION, 3, 1, _short(v, order))],
                                                        order)] for v in range(1, 9) for order in ("little", "big")},
    "no segment": [],
    "exif without the tag": [b"Exif\0\0" + _tiff([(0x010F, 2, 4, b"cam\0")], "little")],
    "tag 0 (invalid)": [b"Exif\0\0" + _tiff([(ORIENTATION, 3, 1, _short(0, "big"))], "big")],
    "tag 9 (invalid)": [b"Exif\0\0" + _tiff([(ORIENTATION, 3, 1, _short(9, "little"))], "little")],
    "a LONG tag": [b"Exif\0\0" + _tiff([(ORIENTATION, 4, 1, (6).to_bytes(4, "little"))], "little")],
    "xmp attribute": [_XMP + b'<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'],
    "xmp element": [_XMP + b"<x:xmpmeta><tiff:Orientation>3</tiff:Orientation></x:xmpmeta>"],
    "exif before xmp": [b"Exif\0\0" + _tiff([(ORIENTATION, 3, 1, _short(6, "big"))], "big"),
                        _XMP + b'<rdf:Description tiff:Orientation="8"/>'],
    "xmp where exif has no tag": [b"Exif\0\0" + _tiff([(0x010F, 2, 4, b"cam\0")], "big"),
                                  _XMP + b'<rdf:Description tiff:Orientation="5"/>'],
    "two xmp segments": [_XMP + b'tiff:Orientation="2"', _XMP + b'tiff:Orientation="7"'],
    "doubled exif header": [b"Exif\0\0Exif\0\0" + _tiff([(ORIENTATION, 3, 1, _short(6, "little"))], "little")],
    "two exif segments": [b"Exif\0\0" + _tiff([(0x010F, 2, 4, b"cam\0")], "big"),
                          b"Exif\0\0" + _tiff([(ORIENTATION, 3, 1, _short(6, "big"))], "big")],
    "truncated exif": [b"Exif\0\0" + _tiff([(ORIENTATION, 3, 1, _short(6, "big"))], "big")[:12]],
    "not a tiff": [b"Exif\0\0" + b"garbage!" * 4],
}


@pytest.mark.parametrize("case", list(_ORIENTATION_CASES))
def test_the_orientation_read_from_the_bytes_is_pils(case):
    """jpeg_orientation reads the tag from the JPEG's bytes without opening it (0.02 ms against PIL's 0.11):
    the value PIL's ``getexif`` gives (its Exif segment's IFD0, else XMP's ``tiff:Orientation``), 1 where
    that is missing or not 1-8, in every case here, well-formed or not."""
    import warnings

    from vitlab.data.decode import _scan_orientation, jpeg_orientation

    data = _with_segments(_ORIENTATION_CASES[case])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL warns of the corrupt cases
        value = Image.open(io.BytesIO(data)).getexif().get(ORIENTATION, 1)
    expected = value if isinstance(value, int) and 1 <= value <= 8 else 1
    assert jpeg_orientation(data) == expected
    if case.startswith("tag ") and "invalid" not in case:
        assert expected == int(case[4])  # the cases say what they test
    # Only the malformed and the doubled go to PIL: the rest are read from the bytes.
    assert (_scan_orientation(data) is None) == (case in ("doubled exif header", "two exif segments",
                                                          "truncated exif", "not a tiff"))
