"""The language-model task: windows, the loop, evaluation, sampling, bad input."""
from __future__ import annotations

import json
import math
import os
import shutil
import threading
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.config import load_config
from vitlab.data import corpus
from vitlab.data.corpus import CharTokenizer, WindowLoader, read_corpus, split_tokens, tiny_shakespeare
from vitlab.errors import DataError
from vitlab.training import train
from conftest import reset_accelerate

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = os.environ.get("VITLAB_TINYSHAKESPEARE")


def test_evaluation_windows_cover_every_validation_token_once_over_processes():
    tokens = torch.arange(1000)
    seen = []
    for rank in range(3):
        loader = WindowLoader(tokens, 16, 8, "cpu", train=False, num_processes=3, process_index=rank)
        batches = list(loader)
        assert len(batches) == len(loader) == 9  # 62 whole windows in 8 batches + the 7-token tail, on every process
        for x, y in batches:
            assert torch.equal(y, x + 1)  # next tokens
            seen.append(y.flatten())
    seen = torch.cat(seen).sort().values
    assert torch.equal(seen, torch.arange(1, 1000))  # every token but the first predicted exactly once


def test_training_windows_are_one_global_batch_split_over_processes():
    tokens = torch.arange(5000)
    one = [x for x, _ in WindowLoader(tokens, 32, 12, "cpu", steps=3, seed=7)]
    two = [[x for x, _ in WindowLoader(tokens, 32, 12, "cpu", steps=3, seed=7, num_processes=2, process_index=r)]
           for r in range(2)]
    for step in range(3):
        assert torch.equal(torch.cat([two[0][step], two[1][step]]), one[step])
    again = WindowLoader(tokens, 32, 12, "cpu", steps=3, seed=7)
    again.set_epoch(1)
    assert not torch.equal(next(iter(again))[0], one[0])  # another epoch, other windows


def test_language_model_stopped_inside_an_epoch_resumes_bit_identical(tmp_path, monkeypatch, on_cpu):
    # Random windows (their own stream, replayed up to the stop) and dropout (the checkpointed global one).
    from safetensors.torch import load_file

    from conftest import same_run_records, signal_at_step
    from vitlab.errors import Preempted

    text = tmp_path / "text.txt"
    text.write_text("".join(chr(97 + (i * i) % 26) for i in range(6000)))
    overrides = [f"data.root={text}", "model.depth=1", "model.embed_dim=32", "model.num_heads=2", "model.dropout=0.1",
                 "data.block_size=16", "data.steps_per_epoch=5", "train.batch_size=8", "train.epochs=2",
                 "train.log_every=2"]
    cfg = lambda run: load_config(ROOT / "configs/lm_shakespeare_char_cpu.yaml", overrides + [f"train.output_dir={run}"])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(cfg(whole))
    reset_accelerate()
    with monkeypatch.context() as m:
        signal_at_step(m, 3)
        with pytest.raises(Preempted):
            train(cfg(parts))
    reset_accelerate()
    train(cfg(parts))
    a = load_file(str(whole / "checkpoints/last/model.safetensors"))
    b = load_file(str(parts / "checkpoints/last/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert same_run_records(whole, parts)


def test_bad_text_input_is_one_clear_line(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        read_corpus(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="validation text has 10 tokens, fewer than data.block_size"):
        split_tokens(list(range(100)), 0.1, 64)
    with pytest.raises(DataError, match="outside the model's 3-character vocabulary: 'z'"):
        CharTokenizer.from_text("abc").encode_text("abz")


@pytest.fixture
def http_folder(tmp_path):
    """A folder served over HTTP on localhost: ``(folder, base_url)``."""
    folder = tmp_path / "served"
    folder.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_tiny_shakespeare_download_is_checked_and_never_left_half_written(tmp_path, monkeypatch, http_folder):
    served, url = http_folder
    with pytest.raises(DataError, match="not found at .*set data.download=true"):
        tiny_shakespeare(tmp_path)
    (served / "wrong.txt").write_text("not Shakespeare")
    monkeypatch.setattr(corpus, "TINY_SHAKESPEARE_URL", f"{url}/wrong.txt")
    with pytest.raises(DataError, match="could not download tiny Shakespeare .*data.dataset=text"):
        tiny_shakespeare(tmp_path / "data", download=True)  # the checksum fails
    assert not any((tmp_path / "data" / "tinyshakespeare").iterdir())  # nothing half-written stays
    monkeypatch.setattr(corpus, "TINY_SHAKESPEARE_URL", f"{url}/missing.txt")
    with pytest.raises(DataError, match="could not download tiny Shakespeare"):
        tiny_shakespeare(tmp_path / "data", download=True)  # HTTP 404
    if SHAKESPEARE:
        shutil.copy(SHAKESPEARE, served / "input.txt")
        monkeypatch.setattr(corpus, "TINY_SHAKESPEARE_URL", f"{url}/input.txt")
        path = tiny_shakespeare(tmp_path / "data", download=True)
        assert path == tmp_path / "data" / "tinyshakespeare" / "input.txt" and len(read_corpus(path)) == 1_115_394
        assert tiny_shakespeare(tmp_path / "data") == path  # found, not fetched again


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE, reason="tiny Shakespeare not available: set VITLAB_TINYSHAKESPEARE")
def test_char_gpt_learns_tiny_shakespeare_and_eval_and_sample_agree(tmp_path, capsys):
    run_dir = tmp_path / "lm"
    summary = train(load_config(ROOT / "configs/lm_shakespeare_char_cpu.yaml", [
        f"data.root={SHAKESPEARE}", f"train.output_dir={run_dir}", "data.steps_per_epoch=30", "train.epochs=2",
        "optim.warmup_epochs=0.5", "train.eval_every=0", "data.block_size=32"]))
    # It uses context: well below the validation cross-entropy of the training text's character frequencies
    # (3.35 nats; a unigram model). 60 steps reach 2.58 with a context of 32 (7 s on one thread; 2.71 with the
    # config's 64, in 11 s), 120 steps 2.42 with 64.
    text = Path(SHAKESPEARE).read_text(encoding="utf-8")
    train_text, val_text = text[:int(0.9 * len(text))], text[int(0.9 * len(text)):]
    counts = Counter(train_text)
    unigram = -sum(math.log(counts[c] / len(train_text)) for c in val_text) / len(val_text)
    assert summary["val_loss"] < unigram - 0.5, (summary["val_loss"], unigram)
    assert summary["best_epoch"] == 2 and summary["best_metric"] == summary["val_loss"]
    out = tmp_path / "m.json"
    main(["eval", "--checkpoint", str(run_dir), "--output", str(out)])
    m = json.loads(out.read_text())
    assert m["loss"] == pytest.approx(summary["val_loss"], abs=1e-6)  # the whole validation split, both times
    assert m["num_tokens"] == 111_540 - 1  # nanoGPT's prepare.py: "val has 111,540 tokens"; all but the first predicted
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"])) and m["bpc"] == pytest.approx(m["loss"] / math.log(2))
    sample = ["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "3"]
    capsys.readouterr()
    main(sample)
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and len(first.rstrip("\n")) == 46
    main(sample)
    assert capsys.readouterr().out == first
    with pytest.raises(SystemExit) as bad:
        main(sample[:-4] + ["--prompt", "ROMEO€"])
    err = capsys.readouterr().err
    assert bad.value.code == 1 and err.count("\n") == 1 and "'€'" in err
    pattern = tmp_path / "pattern.png"
    main(["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--attention",
          str(pattern)])
    with Image.open(pattern) as img:
        assert img.format == "PNG" and img.size[0] > 100
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--attention", str(tmp_path / "x.png"),
              "--layer", "4"])
    assert exit_info.value.code == 2 and not (tmp_path / "x.png").exists()
