"""vitlab predict as a batch job (issue 51, 1): folders and globs into a CSV or JSON-lines file, the numbers
vitlab eval gives, unreadable images as rows, a stopped job continued without a row twice or missing."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def trained(tiny_run):
    return tiny_run


def test_a_folder_into_a_csv_file_gives_the_probabilities_vitlab_eval_gives(trained, tiny_imagefolder, tmp_path,
                                                                            capsys, on_cpu):
    from vitlab.cli import main

    main(["eval", "--checkpoint", str(trained), "--predictions", str(tmp_path / "eval.csv")])
    reset_accelerate()
    main(["predict", "--checkpoint", str(trained), "--output", str(tmp_path / "p.csv"), "--batch-size", "5",
          "--topk", "3", str(tiny_imagefolder / "test")])
    assert "36 images -> " in capsys.readouterr().out
    theirs = {r["image"]: r for r in csv.DictReader((tmp_path / "eval.csv").open())}
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    test = tiny_imagefolder / "test"
    assert [r["image"] for r in rows] == sorted(str(p) for p in test.rglob("*.png"))  # every image once, in order
    for r in rows:
        expected = theirs[str(Path(r["image"]).relative_to(test))]
        assert r["error"] == "" and r["class_1"] == expected["prediction"]
        for rank in (1, 2, 3):
            assert float(r[f"prob_{rank}"]) == pytest.approx(float(expected[f"prob_{r[f'class_{rank}']}"]), abs=1e-5)
            assert int(r[f"index_{rank}"]) == int(r[f"class_{rank}"].split("_")[1])


def _top3(path: Path) -> dict[str, list[float]]:
    return {r["image"]: [float(r[f"prob_{k}"]) for k in (1, 2, 3)] for r in csv.DictReader(path.open())}


def test_a_run_trained_in_bf16_is_predicted_at_its_precision_as_eval_evaluates_it(tiny_imagefolder, tmp_path, on_cpu):
    # eval runs a checkpoint at its run's train.mixed_precision (Accelerate's autocast, on the CPU too); predict
    # reads the precision the checkpoint records, so its probabilities are eval's on every device (a float32
    # run's on a GPU too, where predict's default had been bf16), the chunks of the CPU forward pass included.
    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.training import train

    run, test = tmp_path / "run", tiny_imagefolder / "test"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run, "train.epochs=1", "data.loader=torch",
                                           "train.mixed_precision=bf16")))
    reset_accelerate()
    assert load_model(run).pretrained_cfg["training"]["mixed_precision"] == "bf16"
    main(["eval", "--checkpoint", str(run), "--predictions", str(tmp_path / "eval.csv")])
    reset_accelerate()
    theirs = {r["image"]: r for r in csv.DictReader((tmp_path / "eval.csv").open())}
    for precision in ("run", "no"):
        main(["predict", "--checkpoint", str(run), "--output", str(tmp_path / f"{precision}.csv"), "--batch-size", "5",
              "--num-workers", "0", "--topk", "3", "--precision", precision, str(test)])
    rows = list(csv.DictReader((tmp_path / "run.csv").open()))
    assert len(rows) == 36
    worst = {"run": 0.0, "no": 0.0}
    for precision in worst:
        for image, probs in _top3(tmp_path / f"{precision}.csv").items():
            row = next(r for r in rows if r["image"] == image)
            expected = theirs[str(Path(image).relative_to(test))]
            want = [float(expected[f"prob_{row[f'class_{k}']}"]) for k in (1, 2, 3)]
            worst[precision] = max(worst[precision], *(abs(a - b) for a, b in zip(probs, want)))
    assert worst["run"] < 1e-5 < 1e-4 < worst["no"]  # float32 differs from eval's bf16 by bf16's rounding


def test_the_default_device_is_this_processs_gpu_unless_the_launch_keeps_it_on_the_cpu(monkeypatch):
    # accelerate launch --cpu (ACCELERATE_USE_CPU) keeps every process on the CPU where a GPU is, as training and
    # eval do (on an H100 predict took the GPU there, and a second process asked for cuda:1).
    from vitlab.prediction import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert default_device() == torch.device("cuda:1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert default_device() == torch.device("cpu")


def test_an_unreadable_image_is_a_row_with_its_error_and_a_glob_reads_into_folders(trained, tiny_imagefolder,
                                                                                    tmp_path, capsys):
    from vitlab.prediction import predict_images
    from vitlab import load_model

    images = tmp_path / "images"
    shutil.copytree(tiny_imagefolder / "test" / "class_0", images / "a")
    (images / "a" / "broken.png").write_bytes(b"not a png")
    result = predict_images(load_model(trained), [str(images / "**" / "*.png")], tmp_path / "p.jsonl", batch_size=4,
                            num_workers=0)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert result == {"images": 13, "unreadable": 1, "resumed": 0} and len(rows) == 13
    broken = next(r for r in rows if r["image"].endswith("broken.png"))
    assert set(broken) == {"image", "error"} and "cannot read image" in broken["error"]
    good = [r for r in rows if "error" not in r]
    assert all(len(r["classes"]) == 3 and sum(r["probs"]) == pytest.approx(1, abs=1e-5) for r in good)
    out = capsys.readouterr().out
    assert "13 images -> " in out and "; 1 could not be read (their rows give the error)" in out


def test_an_image_over_the_pixel_limit_is_a_row_with_its_error_and_training_refuses_it(trained, tiny_imagefolder,
                                                                                       tmp_path, on_cpu):
    """--max-image-pixels (predict, embed) and data.max_image_pixels (training) refuse an image from its header."""
    from PIL import Image

    from vitlab import load_model
    from vitlab.config import load_config
    from vitlab.errors import DataError
    from vitlab.prediction import predict_images
    from vitlab.training import train

    images = tmp_path / "images"
    shutil.copytree(tiny_imagefolder / "test" / "class_0", images)  # 32 x 32: 1,024 pixels
    Image.new("RGB", (40, 30), (9, 9, 9)).save(images / "large.jpg")  # 1,200 pixels
    result = predict_images(load_model(trained), [str(images)], tmp_path / "p.jsonl", num_workers=0,
                            max_pixels=1100)
    rows = {Path(r["image"]).name: r for r in map(json.loads, (tmp_path / "p.jsonl").read_text().splitlines())}
    assert result["unreadable"] == 1 and set(rows["large.jpg"]) == {"image", "error"}
    assert "is 40 x 30 = 1,200 pixels, more than the 1,100 this reader takes" in rows["large.jpg"]["error"]
    assert sum("error" not in r for r in rows.values()) == 12
    predict_images(load_model(trained), [str(images)], tmp_path / "free.jsonl", num_workers=0)  # no limit
    free = {Path(r["image"]).name: r for r in map(json.loads, (tmp_path / "free.jsonl").read_text().splitlines())}
    assert all(free[n] == r for n, r in rows.items() if "error" not in r)  # the images under it: the same pixels
    with pytest.raises(DataError, match=r"is 32 x 32 = 1,024 pixels, more than the 1,000 this reader takes"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.max_image_pixels=1000",
                                                  "data.loader=torch", "data.in_memory=false")))
    reset_accelerate()


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_stopped_job_continues_where_it_stopped_without_a_row_twice_or_missing(trained, tiny_imagefolder, tmp_path,
                                                                                 suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    from vitlab import load_model
    from vitlab.prediction import predict_images

    model, inputs = load_model(trained), [str(tiny_imagefolder / "test")]
    whole, parts = tmp_path / f"whole{suffix}", tmp_path / f"parts{suffix}"
    predict_images(model, inputs, whole, batch_size=5, num_workers=0)
    predict_images(model, inputs, parts, batch_size=5, num_workers=0, stop_after_batches=3)
    partial = parts.with_name(parts.name + ".partial")
    assert not parts.exists() and partial.is_file()
    with partial.open("a") as f:
        f.write('"half a row')  # stopped in the middle of writing a row
    assert predict_images(model, inputs, parts, batch_size=5, num_workers=0)["resumed"] == 15
    if suffix == ".parquet":
        import pyarrow.parquet

        mine, theirs = (pyarrow.parquet.read_table(f).to_pylist() for f in (parts, whole))
        assert mine == theirs and len(mine) == 36 and set(mine[0]) == {"image", "classes", "indices", "probs"}
    else:
        assert parts.read_text() == whole.read_text()
    assert not partial.exists()
    predict_images(model, inputs, parts, batch_size=5, num_workers=0, stop_after_batches=1)
    with pytest.raises(DataError, match=r"was written for other inputs"):
        predict_images(model, [str(tiny_imagefolder / "train")], parts, num_workers=0)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet", ".npy"])
def test_a_stopped_job_is_continued_only_by_the_same_job(trained, tiny_imagefolder, tmp_path, suffix):
    # rows of two checkpoints, top-k settings or augmentations in one file would be a wrong result without a word
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    from vitlab import load_model
    from vitlab.prediction import embed_images, predict_images

    model, inputs, out = load_model(trained), [str(tiny_imagefolder / "test")], tmp_path / f"p{suffix}"
    job = (lambda m, **kw: embed_images(m, inputs, out, batch_size=5, num_workers=0, **kw)) if suffix == ".npy" else \
        (lambda m, **kw: predict_images(m, inputs, out, batch_size=5, num_workers=0, **{"topk": 3, **kw}))
    job(model, stop_after_batches=2)
    other = load_model(trained)
    with torch.no_grad():
        other.head.weight.add_(1e-3)  # another checkpoint: other weights
    changes = [((other,), {}, r"another checkpoint \(weights\)"),
               ((model,), {"precision": "bf16"}, r"precision float32 there, bfloat16 now"),
               ((model,), {"max_pixels": 10**6}, r"max_pixels None there, 1000000 now")]  # which images are errors
    if suffix != ".npy":  # embeddings have no top k, and no augmented views
        changes += [((model,), {"topk": 1}, r"topk 3 there, 1 now"),
                    ((model,), {"tta": "flip"}, r"tta none there, flip now")]
    for args, kw, said in changes:
        with pytest.raises(DataError, match=rf"^{out}.partial holds rows of another job \(.*{said}.*\); run the job it "
                                            rf"was started with to continue it, or remove it to start again$"):
            job(*args, **kw)
    model.pretrained_cfg["temperature"] = 2.0  # vitlab calibrate since: the probabilities change
    if suffix != ".npy":
        with pytest.raises(DataError, match=r"another checkpoint \(checkpoint record\)"):
            job(model)
    model.pretrained_cfg.pop("temperature")
    assert job(model)["resumed"] == 10  # the same job continues
    assert not out.with_name(out.name + ".partial.job.json").exists()


def test_a_continued_csv_job_reads_back_file_names_with_line_breaks(trained, tiny_imagefolder, tmp_path):
    # csv quotes a name holding a newline; U+2028 and a form feed are no line ends to it (Python's splitlines
    # splits at them)
    from vitlab import load_model
    from vitlab.prediction import predict_images

    folder = tmp_path / "odd"
    folder.mkdir()
    sources = sorted((tiny_imagefolder / "test" / "class_0").iterdir())[:7]
    for i, name in enumerate(["a\nb", "c\u2028d", "e\x0cf", 'g "quoted"', "h,comma", "plain", "z\r\nz"]):
        shutil.copy(sources[i], folder / f"{name}.png")
    model = load_model(trained)
    whole, parts = tmp_path / "whole.csv", tmp_path / "parts.csv"
    predict_images(model, [str(folder)], whole, batch_size=2, num_workers=0)
    for _ in range(2):  # stopped twice, after a batch of 2 each time
        predict_images(model, [str(folder)], parts, batch_size=2, num_workers=0, stop_after_batches=1)
    with parts.with_name("parts.csv.partial").open("a") as f:
        f.write('"half\na row')  # stopped in the middle of writing a quoted name
    assert predict_images(model, [str(folder)], parts, batch_size=2, num_workers=0)["resumed"] == 4
    assert parts.read_bytes() == whole.read_bytes()
    rows = list(csv.DictReader(whole.open(newline="")))
    assert sorted(Path(r["image"]).name for r in rows) == sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("args, said", [
    (["predict", "--topk", "0"], r"--topk 0: give how many classes a row lists, 1 or more"),
    (["predict", "--topk", "-1"], r"--topk -1: give how many classes a row lists, 1 or more"),
    (["eval", "--knn", "-1"], r"--knn -1: give the number of neighbours, 1 or more \(0: no k-NN\)"),
])
def test_counts_below_their_least_are_one_line(trained, tiny_imagefolder, tmp_path, capsys, args, said):
    from vitlab.cli import main

    inputs = [str(tiny_imagefolder / "test"), "--output", str(tmp_path / "p.csv")] if args[0] == "predict" else []
    with pytest.raises(SystemExit) as exited:
        main([args[0], "--checkpoint", str(trained), *args[1:], *inputs])
    assert exited.value.code == 2 and capsys.readouterr().err.strip() == f"error: {said.replace(chr(92), '')}"
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "p.csv.partial").exists()


@pytest.mark.parametrize("source", ["imagefolder", "hf"])
def test_a_data_sets_split_named_by_data_keys_gives_the_rows_its_files_give(trained, tiny_imagefolder, tmp_path,
                                                                           source):
    from vitlab.cli import main

    test = tiny_imagefolder / "test"
    files = sorted(test.rglob("*.png"))
    if source == "hf":  # the same images as a saved Hugging Face data set, a row each, in the files' order
        datasets = pytest.importorskip("datasets")
        classes = sorted(p.name for p in test.iterdir())
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
        datasets.DatasetDict({"test": datasets.Dataset.from_dict(
            {"image": [str(f) for f in files], "label": [classes.index(f.parent.name) for f in files]},
            features=features)}).save_to_disk(str(tmp_path / "saved"))
        keys = ["data.dataset=hf", f"data.root={tmp_path / 'saved'}"]
        names = [str(i) for i in range(len(files))]
    else:
        keys = ["data.dataset=imagefolder", f"data.root={tiny_imagefolder}"]
        names = [str(f.relative_to(test)) for f in files]
    main(["predict", "--checkpoint", str(trained), "--output", str(tmp_path / "files.jsonl"), "--num-workers", "0",
          str(test)])
    main(["predict", "--checkpoint", str(trained), "--output", str(tmp_path / "split.jsonl"), "--num-workers", "1",
          "--batch-size", "7", "--split", "test", *keys])
    reset_accelerate()
    by_files, by_split = ([json.loads(line) for line in (tmp_path / f).read_text().splitlines()]
                          for f in ("files.jsonl", "split.jsonl"))
    assert [r["image"] for r in by_split] == names  # the split's keys: paths in its folder, row numbers
    for a, b in zip(by_files, by_split):
        assert a["classes"] == b["classes"] and a["probs"] == pytest.approx(b["probs"], abs=1e-6)
    main(["embed", "--checkpoint", str(trained), "--output", str(tmp_path / "e.npy"), "--num-workers", "0", *keys])
    assert (tmp_path / "e.paths.txt").read_text().splitlines() == names
    if source == "hf":  # a split to predict often has no labels: listed all the same
        datasets.DatasetDict({"test": datasets.Dataset.from_dict({"image": [str(f) for f in files]}, features=
                              datasets.Features({"image": datasets.Image()}))}).save_to_disk(str(tmp_path / "bare"))
        main(["predict", "--checkpoint", str(trained), "--output", str(tmp_path / "bare.jsonl"), "--num-workers", "0",
              "data.dataset=hf", f"data.root={tmp_path / 'bare'}"])
        bare = [json.loads(line) for line in (tmp_path / "bare.jsonl").read_text().splitlines()]
        assert [r["image"] for r in bare] == names
        for a, b in zip(bare, by_split):  # other batches than the labelled split's: equal to float rounding
            assert a["classes"] == b["classes"] and a["probs"] == pytest.approx(b["probs"], abs=1e-6)


def test_shards_are_read_in_order_by_workers_and_give_the_rows_of_the_files_they_were_written_from(
        trained, tiny_imagefolder, tmp_path):
    # vitlab shards names a sample <split>_<its index in the split's listing>; a row names it <shard>:<position>.
    pytest.importorskip("webdataset")
    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.data.shards import read_samples
    from vitlab.prediction import predict_images

    main(["shards", str(tiny_imagefolder), str(tmp_path / "shards"), "--split", "test", "--shard-size", "10"])
    files = sorted((tiny_imagefolder / "test").rglob("*.png"))
    model = load_model(trained)
    predict_images(model, [str(f) for f in files], tmp_path / "files.jsonl", batch_size=4, num_workers=0)
    by_file = {r["image"]: r for r in map(json.loads, (tmp_path / "files.jsonl").read_text().splitlines())}
    keys = ["data.dataset=wds", f"data.root={tmp_path / 'shards'}"]
    whole, parts = tmp_path / "shards.jsonl", tmp_path / "parts.jsonl"
    predict_images(model, [], whole, batch_size=4, num_workers=2, data=keys)  # 2 workers, batches in turn
    predict_images(model, [], parts, batch_size=4, num_workers=2, data=keys, stop_after_batches=3)
    assert predict_images(model, [], parts, batch_size=4, num_workers=2, data=keys)["resumed"] == 12
    assert parts.read_text() == whole.read_text()
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    order = [(shard.name, position, int(sample["__key__"].rsplit("_", 1)[1]))
             for shard in sorted((tmp_path / "shards").glob("test-*.tar"))
             for position, sample in enumerate(read_samples(str(shard)))]
    assert [r["image"] for r in rows] == [f"{name}:{position}" for name, position, _ in order] and len(rows) == 36
    for row, (_, _, i) in zip(rows, order):
        expected = by_file[str(files[i])]
        assert row["classes"] == expected["classes"] and row["probs"] == pytest.approx(expected["probs"], abs=1e-6)


def test_bad_inputs_are_one_line_before_anything_is_written(trained, tmp_path):
    from vitlab import load_model
    from vitlab.prediction import predict_images

    model = load_model(trained)
    (tmp_path / "empty").mkdir()
    for inputs, output, error, message in (
            ([str(tmp_path / "nothing-*.png")], "p.csv", DataError, r"^the pattern .* matches no file$"),
            ([str(tmp_path / "empty")], "p.csv", DataError, r"^the folder .* holds no images"),
            ([str(tmp_path / "missing.png")], "p.csv", DataError, r"missing.png': no such file or folder$"),
            ([str(tmp_path)], "p.txt", ConfigError, r"^--output .*p.txt: write predictions as .csv, .jsonl, .parquet")):
        with pytest.raises(error, match=message):
            predict_images(model, inputs, tmp_path / output)
    for inputs, data, message in (
            ([str(tmp_path)], ["data.dataset=imagefolder"], r"^give image files, folders and globs .* or a data set "
                                                           r"\(data.\* keys\), not both$"),
            ([], ["train.epochs=1"], r"^'train.epochs=1': predict and embed take data.\* keys")):
        with pytest.raises(ConfigError, match=message):
            predict_images(model, inputs, tmp_path / "p.csv", data=data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_folder_of_linked_class_folders_lists_the_files_torchvisions_image_folder_lists(tiny_imagefolder,
                                                                                          tmp_path):
    # Class folders are often links into another tree (a subset of a data set): torchvision's ImageFolder follows
    # them (os.walk(followlinks=True)), so a folder that trains must predict.
    from torchvision.datasets import ImageFolder

    from vitlab.prediction import list_images

    for c in ("class_0", "class_1"):
        (tmp_path / "linked" / c).parent.mkdir(exist_ok=True)
        (tmp_path / "linked" / c).symlink_to(tiny_imagefolder / "test" / c)
    listed = list_images([str(tmp_path / "linked")])
    assert listed == sorted(path for path, _ in ImageFolder(str(tmp_path / "linked")).samples) and len(listed) == 24


def test_the_cpu_forward_runs_cache_sized_chunks_side_by_side_with_the_rows_of_the_whole_batch(
        trained, tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # On a CPU a batch of 256 small images at once spills the caches (issue 51: chunks ran the quick model 1.7x
    # faster): the chunk holds the widest layer's activations within the budget, or within the weights' size.
    import threading

    import timm

    import vitlab
    from vitlab import load_model
    from vitlab.inference import forward
    from vitlab.inference.forward import cpu_chunk
    from vitlab.prediction import predict_images

    quick = vitlab.create_model("vit_cifar_tiny_patch4_32")  # 96 wide (qkv 288), 8 x 8 patches and a CLS token
    assert cpu_chunk(quick, (3, 32, 32)) == forward.CPU_ACTIVATION_BUDGET // (65 * 288 * 4) == 28
    small = timm.create_model("vit_small_patch16_224")  # 22M weights (88 MB), MLP 1536, 197 tokens
    weights = sum(p.numel() * 4 for p in small.parameters())
    assert cpu_chunk(small, (3, 224, 224)) == weights // (197 * 1536 * 4) == 72
    model = load_model(trained)
    whole, chunked = tmp_path / "whole.jsonl", tmp_path / "chunked.jsonl"
    predict_images(model, [str(tiny_imagefolder / "test")], whole, batch_size=5, num_workers=0)
    monkeypatch.setattr(forward, "CPU_ACTIVATION_BUDGET", 2 * 65 * 96 * 4)  # 2 images' qkv: chunks of 2, 2, 1
    assert cpu_chunk(model, (3, 32, 32)) == 2
    # The chunks run side by side, in as many threads as torch had (here 2), each on one of torch's threads (whose
    # own threads wait for each other, spinning, when a worker takes a core); torch's threads come back at the end.
    calls: list[tuple[int, int, int]] = []
    hook = model.register_forward_hook(lambda module, args, output: calls.append(
        (len(args[0]), threading.get_ident(), torch.get_num_threads())))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        predict_images(model, [str(tiny_imagefolder / "test")], chunked, batch_size=5, num_workers=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
        hook.remove()
    # the blank image cpu_chunk measures, then 7 batches of 5 and one of 1 (their chunks in any order), in the
    # pool's threads at one torch thread
    assert calls[0][0] == 1 and sorted(n for n, _, _ in calls[1:]) == sorted([2, 2, 1] * 7 + [1])
    assert calls[0][1] == threading.get_ident() and threading.get_ident() not in {t for _, t, _ in calls[1:]}
    assert {n for _, _, n in calls[1:]} == {1}
    rows = [json.loads(line) for line in chunked.read_text().splitlines()]
    expected = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["classes"] for r in rows] == [r["classes"] for r in expected] and len(rows) == 36
    assert all(r["probs"] == pytest.approx(e["probs"], abs=1e-6) for r, e in zip(rows, expected))


def test_photos_larger_than_the_model_are_read_as_vitlab_eval_reads_them(trained, tiny_imagefolder, tmp_path, on_cpu):
    # JPEGs of 100 x 80 px for a 32 px model: decoded only as large as needed (libjpeg-turbo's DCT scaling) and
    # resized as eval resizes a split's files, so the probabilities are eval's.
    from PIL import Image

    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.prediction import predict_images

    photos = tmp_path / "photos"
    for split in ("train", "test"):
        for f in sorted((tiny_imagefolder / split).rglob("*.png"))[::6]:
            out = photos / split / f.parent.name / (f.stem + ".jpg")
            out.parent.mkdir(parents=True, exist_ok=True)
            Image.open(f).convert("RGB").resize((100, 80), Image.BICUBIC).save(out, quality=90)
    main(["eval", "--checkpoint", str(trained), "--predictions", str(tmp_path / "eval.csv"), f"data.root={photos}"])
    reset_accelerate()
    theirs = {r["image"]: r for r in csv.DictReader((tmp_path / "eval.csv").open())}
    predict_images(load_model(trained), [str(photos / "test")], tmp_path / "p.csv", topk=3, num_workers=0)
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert len(rows) == len(theirs) == 6
    for r in rows:
        expected = theirs[str(Path(r["image"]).relative_to(photos / "test"))]
        assert [float(r[f"prob_{k}"]) for k in (1, 2, 3)] == pytest.approx(
            [float(expected[f"prob_{r[f'class_{k}']}"]) for k in (1, 2, 3)], abs=1e-5)


@pytest.mark.multiprocess
def test_two_processes_continue_a_one_process_job_into_one_file_in_the_inputs_order(trained, tiny_imagefolder,
                                                                                         tmp_path, on_cpu):
    from conftest import launch_env, run_two
    from vitlab import load_model
    from vitlab.prediction import predict_images

    inputs = [str(tiny_imagefolder / "test")]
    whole, parts = tmp_path / "whole.csv", tmp_path / "parts.csv"
    predict_images(load_model(trained), inputs, whole, batch_size=5, num_workers=0)
    predict_images(load_model(trained), inputs, parts, batch_size=5, num_workers=0, stop_after_batches=2)
    # the job stopped after 10 rows continues on 2 processes: 26 rows in 3 global batches of 2 x 5, the last uneven
    launched = run_two(["-m", "vitlab.cli", "predict", "--checkpoint", str(trained), "--output", str(parts),
                        "--batch-size", "5", "--num-workers", "1", *inputs], launch_env(2, exact=True))
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "36 images -> " in launched.stdout and "(10 rows from the run before)" in launched.stdout
    mine, theirs = list(csv.DictReader(parts.open())), list(csv.DictReader(whole.open()))
    assert [r["image"] for r in mine] == [r["image"] for r in theirs] and len(mine) == 36
    assert [r["class_1"] for r in mine] == [r["class_1"] for r in theirs]
    assert [float(r["prob_1"]) for r in mine] == pytest.approx([float(r["prob_1"]) for r in theirs], abs=1e-5)


def _flip_reference(model, files):
    """Each image's and its mirror's softmax, averaged (vitlab's own transform for the image)."""
    from PIL import Image

    from vitlab import create_transform

    x = torch.stack([create_transform(model)(Image.open(f)) for f in files])
    return (model(x).softmax(-1) + model(x.flip(-1)).softmax(-1)) / 2


def _crops_reference(model, files):
    """torchvision's FiveCrop of the model's 32 px input size from the image resized to floor(32 / 0.875) = 36
    (the model takes its whole image), the crops' softmaxes averaged."""
    from PIL import Image
    from torchvision.transforms import v2

    from vitlab.data.transforms import ModelInput, eval_transform

    cfg, view, five = model.pretrained_cfg, eval_transform((36, 36)), v2.FiveCrop((32, 32))
    crops = [torch.stack(five(view(v2.functional.pil_to_tensor(Image.open(f).convert("RGB"))))) for f in files]
    return torch.stack([model(ModelInput(cfg["mean"], cfg["std"])(c)).softmax(-1).mean(0) for c in crops])


@pytest.mark.parametrize("tta, reference", [("flip", _flip_reference), ("crops", _crops_reference)])
def test_tta_in_eval_and_predict_gives_the_mean_prediction_of_the_reference_views(trained, tiny_imagefolder, tmp_path,
                                                                                  tta, reference, on_cpu):
    from vitlab import load_model
    from vitlab.cli import main
    from vitlab.prediction import predict_images
    from vitlab.inference.tta import flip_tta

    a, b = torch.randn(4, 5), torch.randn(4, 5)
    net = lambda x: torch.cat([a, b]) if len(x) == 8 else None  # noqa: E731  (the image's logits, then the mirror's)
    torch.testing.assert_close(flip_tta(net, torch.zeros(4, 3, 2, 2)).softmax(-1), (a.softmax(-1) + b.softmax(-1)) / 2)
    torch.testing.assert_close(flip_tta(net, torch.zeros(4, 3, 2, 2), True).sigmoid(), (a.sigmoid() + b.sigmoid()) / 2)
    main(["eval", "--checkpoint", str(trained), "--tta", tta, "--predictions", str(tmp_path / "eval.csv"),
          "--output", str(tmp_path / "m.json")])
    reset_accelerate()
    assert json.loads((tmp_path / "m.json").read_text())["tta"] == tta
    theirs = {r["image"]: r for r in csv.DictReader((tmp_path / "eval.csv").open())}
    model = load_model(trained)
    files = sorted((tiny_imagefolder / "test" / "class_1").glob("*.png"))[:4]
    with torch.no_grad():
        want = reference(model, files)
    for f, p in zip(files, want):
        row = theirs[f"class_1/{f.name}"]
        assert [float(row[f"prob_class_{k}"]) for k in range(3)] == pytest.approx(p.tolist(), abs=1e-5)
    predict_images(model, [str(f) for f in files], tmp_path / "p.jsonl", topk=3, num_workers=0, tta=tta)
    for line, p in zip((tmp_path / "p.jsonl").read_text().splitlines(), want):
        assert json.loads(line)["probs"] == pytest.approx(sorted(p.tolist(), reverse=True), abs=1e-5)
    if tta == "crops":
        from vitlab.evaluation import evaluate_checkpoint

        with pytest.raises(ConfigError, match=r"--knn 3 reads the images at the model's own size; leave out --tta"):
            evaluate_checkpoint(trained, tta="crops", knn=3)


def test_knn_top1_is_scikit_learns_weighted_vote_of_the_nearest_training_images(trained, tiny_imagefolder, tmp_path):
    # DINO's k-NN: cosine similarity, each neighbour weighted by exp(similarity / 0.07); scikit-learn's
    # KNeighborsClassifier with the cosine metric and that weight of its distance (1 - similarity) is the reference.
    import numpy as np
    from PIL import Image
    from sklearn.neighbors import KNeighborsClassifier

    from vitlab import create_transform, load_model
    from vitlab.cli import main
    from vitlab.tasks.knn import pooled_features

    main(["eval", "--checkpoint", str(trained), "--knn", "5", "--output", str(tmp_path / "m.json")])
    reset_accelerate()
    metrics = json.loads((tmp_path / "m.json").read_text())
    model = load_model(trained)

    def features(split: str) -> tuple[np.ndarray, np.ndarray]:
        files = sorted((tiny_imagefolder / split).rglob("*.png"))
        with torch.no_grad():
            f = pooled_features(model, torch.stack([create_transform(model)(Image.open(p)) for p in files]))
        return f.numpy(), np.array([int(p.parent.name.split("_")[1]) for p in files])

    (train_x, train_y), (test_x, test_y) = features("train"), features("test")
    reference = KNeighborsClassifier(5, metric="cosine", weights=lambda d: np.exp((1 - d) / 0.07)).fit(train_x, train_y)
    assert metrics["knn_k"] == 5 and metrics["knn_train_images"] == 96
    assert metrics["knn_top1"] == pytest.approx((reference.predict(test_x) == test_y).mean(), abs=1e-9)
    assert 0 < metrics["knn_top1"] <= 1


@pytest.mark.parametrize("k", [1, 5, 20])
def test_the_weighted_vote_is_scikit_learns_on_features_where_the_weights_decide(k):
    import numpy as np
    from sklearn.neighbors import KNeighborsClassifier

    from vitlab.tasks.knn import knn_predict

    g = torch.Generator().manual_seed(k)
    train, test = torch.randn(300, 8, generator=g), torch.randn(80, 8, generator=g)
    labels = torch.randint(0, 6, (300,), generator=g)
    reference = KNeighborsClassifier(k, metric="cosine", weights=lambda d: np.exp((1 - d) / 0.07))
    theirs = reference.fit(train.numpy(), labels.numpy()).predict(test.numpy())
    mine = knn_predict(train, labels, test, 6, k, chunk=32)
    assert mine.tolist() == theirs.tolist()
    if k > 1:  # a plain majority would differ somewhere: the weights decide
        plain = KNeighborsClassifier(k, metric="cosine").fit(train.numpy(), labels.numpy()).predict(test.numpy())
        assert (plain != theirs).any()


def test_vitlab_embed_writes_the_pooled_features_with_their_paths(trained, tiny_imagefolder, tmp_path, on_cpu):
    import numpy as np
    from PIL import Image

    from vitlab import create_transform, load_model
    from vitlab.cli import main
    from vitlab.tasks.knn import pooled_features

    images = tmp_path / "images"
    shutil.copytree(tiny_imagefolder / "test" / "class_2", images)
    (images / "000_broken.png").write_bytes(b"not a png")
    main(["embed", "--checkpoint", str(trained), "--output", str(tmp_path / "e.npy"), "--num-workers", "0",
          str(images)])
    array = np.load(tmp_path / "e.npy")
    paths = (tmp_path / "e.paths.txt").read_text().splitlines()
    assert array.shape == (13, 32) and array.dtype == np.float32 and paths == sorted(str(p) for p in images.iterdir())
    broken = paths.index(str(images / "000_broken.png"))
    good = [i for i in range(13) if i != broken]
    assert np.isnan(array[broken]).all() and not np.isnan(array[good]).any()  # the broken file: a row of NaN
    model = load_model(trained)
    with torch.no_grad():
        want = pooled_features(model, torch.stack([create_transform(model)(Image.open(paths[i])) for i in good]))
    np.testing.assert_allclose(array[good], want.numpy(), atol=1e-5)
    main(["embed", "--checkpoint", str(trained), "--output", str(tmp_path / "e.jsonl"), "--num-workers", "0",
          str(images)])
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [r["image"] for r in rows] == paths and "error" in rows[broken]
    np.testing.assert_allclose(np.array([rows[i]["embedding"] for i in good]), array[good], atol=1e-6)
    with pytest.raises(SystemExit):
        main(["embed", "--checkpoint", str(trained), "--output", str(tmp_path / "e.csv"), str(images)])


def test_embed_takes_a_backbone_without_class_names(trained, tiny_imagefolder, tmp_path):
    import numpy as np

    from vitlab import load_model
    from vitlab.prediction import embed_images

    model = load_model(trained)
    del model.pretrained_cfg["label_names"]  # a save_pretrained backbone may carry none
    embed_images(model, [str(tiny_imagefolder / "test" / "class_0")], tmp_path / "e.npy", num_workers=0)
    assert np.load(tmp_path / "e.npy").shape == (12, 32)
