"""``vitlab inspect``: out-of-sample probabilities against scikit-learn, the pixel comparison against NumPy, and the
whole command on a small image set with planted wrong labels, copies across splits and an outlier."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import make_imagefolder, train_tiny

pytest.importorskip("cleanlab.datalab.datalab", reason="vitlab[inspect] (cleanlab's Datalab) is not installed")


# -- out-of-sample probabilities ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 5])
def test_knn_probabilities_are_scikit_learns_weighted_vote_and_leave_each_image_out(k):
    from sklearn.neighbors import KNeighborsClassifier

    from vitlab.tasks.knn import knn_probabilities

    g = torch.Generator().manual_seed(k)
    bank, labels = torch.randn(60, 6, generator=g), torch.randint(0, 4, (60,), generator=g)
    weights = lambda d: np.exp((1 - d) / 0.07)  # noqa: E731 (DINO's weights, by cosine distance)
    reference = KNeighborsClassifier(k, metric="cosine", weights=weights).fit(bank.numpy(), labels.numpy())
    queries = torch.randn(9, 6, generator=g)
    mine = knn_probabilities(bank, labels, queries, 4, k, chunk=4)
    assert np.allclose(mine.numpy(), reference.predict_proba(queries.numpy()), atol=1e-5)
    # leave one out: image i voted on by a vote fitted without it
    loo = knn_probabilities(bank, labels, bank, 4, k, chunk=7, leave_one_out=True)
    for i in (0, 17, 59):
        others = torch.arange(60) != i
        alone = KNeighborsClassifier(k, metric="cosine", weights=weights).fit(bank[others].numpy(),
                                                                               labels[others].numpy())
        assert np.allclose(loo[i].numpy(), alone.predict_proba(bank[i:i + 1].numpy())[0], atol=1e-5)
    # multi-label: each class's share is a binary weighted vote for that class
    sets = torch.rand(60, 3, generator=g) < 0.4
    shares = knn_probabilities(bank, sets, queries, 3, k)
    for c in range(3):
        binary = KNeighborsClassifier(k, metric="cosine", weights=weights).fit(bank.numpy(), sets[:, c].numpy())
        expected = binary.predict_proba(queries.numpy())
        expected = expected[:, list(binary.classes_).index(True)] if True in binary.classes_ else np.zeros(9)
        assert np.allclose(shares[:, c].numpy(), expected, atol=1e-5)


def test_cross_fitted_probabilities_never_depend_on_the_images_own_labels():
    from sklearn.linear_model import LogisticRegression

    from vitlab.inspection.probabilities import cross_fitted, fold_of

    g = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.zeros(5), torch.ones(17), torch.full((8,), 2)]).long()  # a rare class of 5
    features = torch.randn(30, 4, generator=g) + 2 * torch.nn.functional.one_hot(labels, 4).float()
    fold = fold_of(labels, 5, seed=0)
    for f in range(5):  # stratified: each class dealt evenly over the folds
        counts = torch.bincount(labels[fold == f], minlength=3)
        assert counts.tolist() in ([1, 3, 1], [1, 3, 2], [1, 4, 1], [1, 4, 2])
    probs = cross_fitted(features, labels, 3, fold)
    flipped = labels.clone()
    flipped[fold == 0] = (flipped[fold == 0] + 1) % 3  # other labels in fold 0 alone
    again = cross_fitted(features, flipped, 3, fold)
    assert torch.allclose(probs[fold == 0], again[fold == 0], atol=1e-6)
    assert not torch.allclose(probs[fold != 0], again[fold != 0], atol=1e-3)
    # each fold's head is scikit-learn's logistic regression (C = 1) fitted on the other folds
    rest = fold != 2
    reference = LogisticRegression(C=1.0, tol=1e-10, max_iter=10000).fit(features[rest].numpy(), labels[rest].numpy())
    assert np.allclose(probs[fold == 2].numpy(), reference.predict_proba(features[fold == 2].numpy()), atol=2e-4)


# -- near-duplicates by the pixels ------------------------------------------------------------------------------------


def test_the_aligned_correlation_is_numpys_at_the_best_shift():
    from vitlab.inspection.duplicates import aligned_correlation

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (3, 32, 32)).astype(np.float32)
    shifted = np.pad(image, ((0, 0), (3, 3), (3, 3)), mode="edge")[:, 3 + 2:3 + 2 + 32, 3 - 1:3 - 1 + 32]
    other = rng.integers(0, 256, (3, 32, 32)).astype(np.float32)
    found = aligned_correlation(torch.from_numpy(image)[None], torch.from_numpy(np.stack([shifted, other]))[None])
    assert found[0, 0].item() == pytest.approx(1.0, abs=1e-5)  # a shifted copy: exactly itself at the right offset
    def channel_centred(a):
        return (a - a.mean(axis=(1, 2), keepdims=True)).ravel()

    best = max(np.dot(u := channel_centred(image[:, 3:29, 3:29]), v := channel_centred(
        other[:, 3 + dy:29 + dy, 3 + dx:29 + dx])) / np.linalg.norm(u) / np.linalg.norm(v)
        for dy in range(-3, 4) for dx in range(-3, 4))
    # a flat colour and the same colour with noise on it: not alike, however alike their colour
    flat = np.zeros((3, 32, 32), np.float32)
    flat[0] = 200
    noisy = flat + rng.normal(0, 40, flat.shape).astype(np.float32)
    pair = aligned_correlation(torch.from_numpy(noisy)[None], torch.from_numpy(noisy[None, :, ::-1].copy())[None])
    assert abs(pair.item()) < 0.3
    assert found[0, 1].item() == pytest.approx(best, abs=1e-5)


# -- the command ----------------------------------------------------------------------------------------------------


def _shifted_jpeg(source: Path, dest: Path, dy: int, dx: int) -> None:
    """A near-duplicate: shifted (edge padding) and re-encoded as a JPEG (its colours kept at full resolution: these
    images are noise, which chroma subsampling would blur away)."""
    a = np.asarray(Image.open(source).convert("RGB"))
    a = np.pad(a, ((3, 3), (3, 3), (0, 0)), mode="edge")[3 - dy:3 - dy + a.shape[0], 3 - dx:3 - dx + a.shape[1]]
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=95, subsampling=0)
    dest.write_bytes(buf.getvalue())


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """3 colour classes (40 training, 12 test images each), with: an image of each class filed under the next class,
    2 test images (a white box drawn on each) copied (shifted, as JPEGs) into the training split, and a grey image
    filed under class_2."""
    root = make_imagefolder(tmp_path_factory.mktemp("planted") / "my data", {"train": 40, "test": 12}, seed=3)
    for i in range(3):
        (root / "train" / f"class_{i}" / "0000.png").rename(root / "train" / f"class_{(i + 1) % 3}" / f"moved {i}.png")
    for name, (y, x) in (("class_1/0005.png", (4, 9)), ("class_2/0007.png", (15, 3))):  # a photo has shapes
        pixels = np.asarray(Image.open(root / "test" / name)).copy()
        pixels[y:y + 12, x:x + 14] = 255
        Image.fromarray(pixels).save(root / "test" / name)
    _shifted_jpeg(root / "test" / "class_1" / "0005.png", root / "train" / "class_1" / "copy a.jpg", 2, -1)
    _shifted_jpeg(root / "test" / "class_2" / "0007.png", root / "train" / "class_2" / "copy b.jpg", -3, 3)
    Image.new("RGB", (32, 32), (120, 120, 120)).save(root / "train" / "class_2" / "grey.png")
    return root


@pytest.fixture(scope="module")
def backbone(planted, tmp_path_factory):
    return train_tiny(planted, tmp_path_factory.mktemp("inspect") / "run", "train.epochs=2", "data.loader=torch")


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _issues(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_inspect_finds_the_planted_labels_and_leaks_and_changes_no_file(planted, backbone, tmp_path, capsys,
                                                                               monkeypatch, on_cpu):
    from vitlab.cli import main
    from vitlab.data.sources import index_split

    before = _digest(planted)
    out = tmp_path / "report"
    main(["inspect", "--checkpoint", str(backbone), "--output", str(out), "--num-workers", "0", "--write-clean",
          str(tmp_path / "clean" / "train.csv"), "data.dataset=imagefolder", f"data.root={planted}"])
    printed = capsys.readouterr().out
    assert _digest(planted) == before  # nothing in the data set was changed
    rows = _issues(out / "issues.csv")
    assert list(rows[0]) == ["split", "image", "issue", "score", "given_label", "suggested_label", "duplicate_of"]
    labels = [r for r in rows if r["issue"] == "label"]
    moved = {f"class_{(i + 1) % 3}/moved {i}.png": f"class_{i}" for i in range(3)}
    assert set(moved) <= {r["image"] for r in labels[:4]}  # the three filed under another class, among the surest 4
    assert all(r["suggested_label"] == moved[r["image"]] for r in labels if r["image"] in moved)
    leaks = {(r["image"], r["duplicate_of"]) for r in rows if r["issue"] == "leak"}
    assert leaks == {("class_1/0005.png", "train:class_1/copy a.jpg"), ("class_2/0007.png", "train:class_2/copy b.jpg")}
    for kind in ("label", "leak", "outlier"):
        scores = [float(r["score"]) for r in rows if r["issue"] == kind]
        assert scores == sorted(scores, reverse=True)  # each kind worst first
    assert (out / "label.png").stat().st_size > 0 and (out / "leak.png").stat().st_size > 0
    summary = {line.split(":")[0]: line for line in printed.splitlines() if line.startswith(("train:", "test:"))}
    assert summary["train"].startswith("train: 123 images; 3 label issues") and "2 leaks" in summary["test"]
    assert "classes from 40 (class_0) to 42 (class_2) images" in printed  # 40, 41 and 42
    # the clean list: what data.dataset=csv reads, without the flagged images
    clean = index_split("csv", tmp_path / "clean", "train")
    kept = {Path(clean.path(i)).resolve() for i in range(len(clean))}
    flagged = {planted / "train" / r["image"] for r in rows if r["split"] == "train"}
    flagged |= {planted / "train" / r["duplicate_of"].split(":", 1)[1] for r in rows if r["issue"] == "leak"}
    assert kept == {p.resolve() for p in (planted / "train").rglob("*.*")} - {p.resolve() for p in flagged}
    assert len(kept) < 123 and not any("moved" in str(p) or "copy" in str(p) for p in kept)
    whole = index_split("csv", tmp_path / "clean", "test")  # the test split beside it, whole
    assert sorted(Path(whole.path(i)).resolve() for i in range(len(whole))) == sorted(
        p.resolve() for p in (planted / "test").rglob("*.png"))
    # a second inspection reads the features it computed (no image decoded for them again)
    import vitlab.prediction

    monkeypatch.setattr(vitlab.prediction, "embed_images", lambda *a, **k: pytest.fail("features computed again"))
    main(["inspect", "--checkpoint", str(backbone), "--output", str(out), "--num-workers", "0", "--folds", "3",
          "data.dataset=imagefolder", f"data.root={planted}"])
    again = _issues(out / "issues.csv")
    assert set(moved) <= {r["image"] for r in again if r["issue"] == "label"}
    assert {(r["image"], r["duplicate_of"]) for r in again if r["issue"] == "leak"} == leaks


@pytest.mark.slow
def test_inspect_reads_streamed_shards_and_finds_what_it_finds_in_the_folders(planted, backbone, tmp_path, on_cpu):
    pytest.importorskip("webdataset")
    from vitlab.cli import main

    main(["shards", str(planted), str(tmp_path / "shards"), "--shard-size", "50"])
    main(["inspect", "--checkpoint", str(backbone), "--output", str(tmp_path / "s"), "--num-workers", "0",
          "data.dataset=wds", f"data.root={tmp_path / 'shards'}"])
    rows = _issues(tmp_path / "s" / "issues.csv")
    assert sum(r["issue"] == "leak" for r in rows) == 2
    assert sum(r["issue"] == "label" for r in rows) >= 3
    assert all(":" in r["image"] for r in rows)  # a shard's sample: <shard>:<position>
    assert (tmp_path / "s" / "leak.png").is_file()


@pytest.mark.slow
def test_inspect_multi_label_data(tmp_path, backbone, planted, on_cpu):
    """Label sets (a csv of JSON lists): cleanlab's multi-label rule; an image missing one of its two colours'
    classes is flagged, the suggestion showing both."""
    from vitlab.cli import main

    root = tmp_path / "ml"
    root.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(240):
        a, b = int(rng.integers(3)), int(rng.integers(3))
        pixels = np.zeros((32, 32, 3))
        pixels[:, :16, a] = 200
        pixels[:, 16:, b] = 200
        Image.fromarray(np.clip(pixels + rng.normal(0, 30, pixels.shape), 0, 255).astype(np.uint8)).save(
            root / f"{i}.png")
        names = sorted({f"class_{a}", f"class_{b}"})
        rows.append((f"{i}.png", names[:1] if i < 24 and len(names) == 2 else names))  # a class left out
    for split in ("train", "test"):
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "labels"])
            w.writerows((p, json.dumps(n)) for p, n in (rows if split == "train" else rows[160:]))
    main(["inspect", "--checkpoint", str(backbone), "--output", str(tmp_path / "o"), "--num-workers", "0",
          "--other-classes", "--splits", "train", "data.dataset=csv", f"data.root={root}"])
    found = _issues(tmp_path / "o" / "issues.csv")
    labels = {r["image"]: r for r in found if r["issue"] == "label"}
    missing = {p: n for p, n in rows[:24] if len(n) == 1 and p in labels}  # flagged among those left short
    assert len(missing) >= 3 and len(missing) >= len(labels) - 1
    for image in missing:
        given, suggested = (json.loads(labels[image][k]) for k in ("given_label", "suggested_label"))
        assert len(given) == 1 and given[0] in suggested and len(suggested) == 2


def test_a_stopped_inspection_continues_its_features_where_they_stopped(planted, backbone, tmp_path, capsys,
                                                                        on_cpu):
    from vitlab.inspection import inspect_data
    from vitlab.inspection.splits import list_splits
    from vitlab.models.registry import load_model
    from vitlab.prediction import embed_images

    model = load_model(backbone)
    data = ["data.dataset=imagefolder", f"data.root={planted}"]
    (train, _), _, _ = list_splits(data, ["train", "test"], True)
    features = tmp_path / "out" / "features"
    features.mkdir(parents=True)
    embed_images(model, [], features / "train.npy", 16, 0, data=train.index, stop_after_batches=2)  # stopped
    assert (features / "train.npy.partial").is_file() and not (features / "train.npy").exists()
    capsys.readouterr()
    found = inspect_data(model, data, tmp_path / "out", num_workers=0, grid=0)
    assert "(32 rows from the run before)" in capsys.readouterr().out  # 2 batches of 16 kept, not computed again
    assert found["counts"]["test"]["leak"] == 2 and np.load(features / "train.npy").shape == (123, 32)


@pytest.mark.parametrize("case", ["one class", "other classes", "folds", "suffix", "cleanlab", "processes",
                                  "clean list in the data", "clean list exists", "test list exists",
                                  "output in the data", "cleanvision"])
def test_bad_requests_are_one_line_before_any_image_is_read(case, planted, backbone, tmp_path, monkeypatch, on_cpu):
    import vitlab.prediction
    from vitlab.errors import ConfigError
    from vitlab.inspection import inspect_data
    from vitlab.models.registry import load_model

    monkeypatch.setattr(vitlab.prediction, "embed_images", lambda *a, **k: pytest.fail("an image was read"))
    model = load_model(backbone)
    data = ["data.dataset=imagefolder", f"data.root={planted}"]
    kwargs: dict = {}
    if case == "one class":
        one = tmp_path / "one"
        shutil.copytree(planted / "test" / "class_0", one / "test" / "class_0")
        shutil.copytree(planted / "train", one / "train")
        data = ["data.dataset=imagefolder", f"data.root={one}"]
        expected = "split 'test' holds one class (class_0)"
    elif case == "other classes":
        model.pretrained_cfg["label_names"] = ["cat", "dog", "class_2"]
        expected = "the checkpoint's 3 classes are not the data's 3 (class_0, class_1 in one and not the other)"
    elif case == "folds":
        kwargs = {"folds": 200}
        expected = "--folds 200: split 'train' has 123 images, fewer than the folds"
    elif case == "suffix":
        kwargs = {"write_clean_to": tmp_path / "clean.txt"}
        expected = "--write-clean"
    elif case == "clean list in the data":  # a csv data set: --write-clean over its own train.csv
        table = tmp_path / "table"
        shutil.copytree(planted / "train", table / "images")
        (table / "train.csv").write_text("image,labels\n" + "".join(
            f"{p.relative_to(table)},{p.parent.name}\n" for p in sorted((table / "images").rglob("*.png"))))
        data = ["data.dataset=csv", f"data.root={table}", "data.test_split=train"]
        kwargs = {"write_clean_to": table / "train.csv"}
        expected = f"--write-clean {table / 'train.csv'}: that is inside the data set being read ({table})"
    elif case == "clean list exists":
        (tmp_path / "mine.csv").write_text("mine\n")
        kwargs = {"write_clean_to": tmp_path / "mine.csv"}
        expected = "that file exists already and vitlab never overwrites"
    elif case == "test list exists":  # the test split's list is written beside the clean one
        (tmp_path / "lists").mkdir()
        (tmp_path / "lists" / "test.csv").write_text("mine\n")
        kwargs = {"write_clean_to": tmp_path / "lists" / "train.csv"}
        expected = "the test split's list beside it, " + str(tmp_path / "lists" / "test.csv")
    elif case == "output in the data":
        kwargs = {"output": planted / "train" / "report"}
        expected = "--output " + str(planted / "train" / "report") + ": that is inside the data set being read"
    elif case == "processes":  # as under torchrun with 2 processes
        import vitlab.inspection.job

        monkeypatch.setattr(vitlab.inspection.job, "processes", lambda: (0, 2, None))
        expected = "vitlab inspect runs in one process"
    else:
        import builtins

        real = builtins.__import__

        missing = "cleanvision" if case == "cleanvision" else "cleanlab"

        def no_cleanlab(name, *a, **k):
            if name.split(".")[0] == missing:
                raise ImportError(f"No module named {missing!r}")
            return real(name, *a, **k)

        monkeypatch.setattr(builtins, "__import__", no_cleanlab)
        expected = "pip install 'vitlab[inspect]'"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.csv")}
    with pytest.raises(ConfigError) as e:
        inspect_data(model, data, kwargs.pop("output", tmp_path / "out"), num_workers=0, **kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not (planted / "train" / "report").exists()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.csv")} == before  # no file of the user's changed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_inspect_and_embed_read_a_self_supervised_models_backbone(kind, planted, tmp_path, on_cpu):
    """An MAE or DINO checkpoint has no head: embed and inspect read its backbone's pooled features (MAE's encoder,
    DINO's teacher), as eval --knn does."""
    import vitlab
    from vitlab.inference.forward import pooled_features
    from vitlab.inspection import inspect_data
    from vitlab.models import create_model
    from vitlab.prediction import embed_images

    extra = dict(decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2) if kind == "mae" else \
        dict(out_dim=64, hidden_dim=32, bottleneck_dim=16)
    ssl = create_model(f"{kind}_vit_cifar_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2, **extra)
    ssl.pretrained_cfg = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}  # as a run records its statistics
    ssl.save_pretrained(tmp_path / kind)
    model = vitlab.load_model(tmp_path / kind)
    files = sorted((planted / "test" / "class_0").glob("*.png"))[:4]
    embed_images(model, [str(f) for f in files], tmp_path / "e.jsonl", 4, 0)
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    from vitlab.data.transforms import ModelInput

    cfg = model.pretrained_cfg
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB"))).permute(2, 0, 1) for f in files])
    with torch.no_grad():
        expected = pooled_features(model.backbone(), ModelInput(cfg["mean"], cfg["std"])(images))
    assert torch.allclose(torch.tensor([r["embedding"] for r in rows]), expected, atol=1e-5)
    found = inspect_data(model, ["data.dataset=imagefolder", f"data.root={planted}"], tmp_path / "report",
                         num_workers=0, grid=0)
    assert found["counts"]["test"]["leak"] == 2  # the thumbnails find the copies whatever the features


@pytest.mark.slow
def test_inspects_cached_features_are_those_of_the_files_not_their_names(planted, backbone, tmp_path, monkeypatch,
                                                                           on_cpu):
    """The same names under another data.root, or a file changed in place, compute the features again."""
    import os

    import vitlab.prediction
    from vitlab.inspection import inspect_data
    from vitlab.models.registry import load_model

    computed = []
    real = vitlab.prediction.embed_images
    monkeypatch.setattr(vitlab.prediction, "embed_images", lambda *a, **k: computed.append(a[2].name) or real(*a, **k))
    model = load_model(backbone)
    other = tmp_path / "other"
    shutil.copytree(planted, other)  # the same names
    rng = np.random.default_rng(0)
    for p in sorted(other.rglob("*.*")):  # ... holding noise
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(p, format="PNG")
    inspect = lambda root: inspect_data(model, ["data.dataset=imagefolder", f"data.root={root}"], tmp_path / "o",
                                        num_workers=0, grid=0)
    assert inspect(planted)["counts"]["test"]["leak"] == 2 and computed == ["train.npy", "test.npy"]
    assert inspect(other)["counts"]["test"]["leak"] == 0 and len(computed) == 4  # not the planted set's features
    inspect(other)
    assert len(computed) == 4  # the same files: read back
    changed = other / "test" / "class_0" / "0001.png"
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(changed, format="PNG")
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    inspect(other)
    assert computed[4:] == ["test.npy"]  # a file changed: its split again


def test_the_agreement_is_scikit_learns_accuracy_or_micro_f1():
    from sklearn.metrics import accuracy_score, f1_score

    from vitlab.inspection.probabilities import agreement

    g = torch.Generator().manual_seed(0)
    probs, labels = torch.rand(50, 4, generator=g), torch.randint(0, 4, (50,), generator=g)
    assert agreement(probs.softmax(1), labels) == pytest.approx(accuracy_score(labels, probs.argmax(1)))
    sets = torch.rand(50, 4, generator=g) > 0.6
    assert agreement(probs, sets) == pytest.approx(f1_score(sets.numpy(), (probs >= 0.5).numpy(), average="micro"))


@pytest.mark.slow
def test_a_model_that_disagrees_with_most_labels_is_said_not_to_be_trusted(planted, backbone, tmp_path, capsys,
                                                                           on_cpu):
    from vitlab.inspection import inspect_data
    from vitlab.models.registry import load_model

    model = load_model(backbone)
    data = lambda root: ["data.dataset=imagefolder", f"data.root={root}"]
    found = inspect_data(model, data(planted), tmp_path / "a", num_workers=0, grid=0, splits=["train"])
    printed = capsys.readouterr().out
    assert found["agreement"]["train"] >= 0.9 and "not to be trusted" not in printed
    share = 100 * found["agreement"]["train"]
    assert f"agree with the given labels (top-1, out of sample): train {share:.1f}%" in printed
    shuffled = tmp_path / "shuffled"
    shutil.copytree(planted, shuffled)
    rng = np.random.default_rng(0)
    for i, p in enumerate(sorted((shuffled / "train").rglob("*.*"))):  # most images filed under another class
        if i % 5:
            p.rename(shuffled / "train" / f"class_{rng.integers(3)}" / f"{i} {p.name}")
    found = inspect_data(model, data(shuffled), tmp_path / "b", num_workers=0, grid=0, splits=["train"])
    printed = capsys.readouterr().out
    assert found["agreement"]["train"] < 0.7
    assert "below 70% (train) the label issues cannot be told from the model's own mistakes and are not to be " \
           "trusted" in printed


def test_frames_without_information_are_their_own_kind_not_duplicates_or_wrong_labels(planted, backbone, tmp_path,
                                                                                       on_cpu):
    """Black, white, one-colour and two-tone frames filed under the classes: CleanVision's kinds alone (as
    cleanlab's image library finds them from the pixels), never near-duplicates of each other or label issues; the
    clean list leaves them out."""
    from vitlab.data.sources import index_split
    from vitlab.inspection import inspect_data
    from vitlab.models.registry import load_model

    root = tmp_path / "data"
    shutil.copytree(planted, root)
    frames = {}
    for i in range(4):
        two = np.zeros((32, 32, 3), np.uint8)
        two[:, 16:] = (40, 200, 90)
        for name, pixels in (("black", np.zeros((32, 32, 3), np.uint8)), ("white", np.full((32, 32, 3), 255, np.uint8)),
                             ("two-tone", two)):
            path = root / "train" / f"class_{i % 3}" / f"{name} {i}.png"
            Image.fromarray(pixels).save(path)
            frames[path.relative_to(root / "train").as_posix()] = name
    found = inspect_data(load_model(backbone), ["data.dataset=imagefolder", f"data.root={root}"], tmp_path / "o",
                         num_workers=0, grid=0, write_clean_to=tmp_path / "clean" / "train.csv")
    kinds: dict[str, set[str]] = {}
    for r in found["issues"]:
        kinds.setdefault(r["image"], set()).add(r["issue"])
        if r["duplicate_of"]:
            kinds.setdefault(r["duplicate_of"].split(":", 1)[1], set()).add(r["issue"])
    for image, name in frames.items():
        assert "low_information" in kinds[image], image
        assert not kinds[image] & {"label", "near_duplicate", "leak", "outlier"}, (image, kinds[image])
    assert {"dark"} <= kinds["class_0/black 0.png"] and {"light"} <= kinds["class_0/white 0.png"]
    clean = index_split("csv", tmp_path / "clean", "train")
    listed = {Path(clean.path(i)).name for i in range(len(clean))}
    assert not listed & {Path(f).name for f in frames}
    assert {"moved 0.png", "copy a.jpg"}.isdisjoint(listed)  # what was found before is still found
