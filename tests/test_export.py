"""Export to ONNX (run in onnxruntime) and torch.export (run in torch): the same outputs as the eager model,
at another batch size than the one exported with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlab
from vitlab import checkpoint as ckpt
from vitlab.cli import main
from vitlab.export import export_model

onnxruntime = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A CIFAR tiny ViT and a text encoder-decoder saved as checkpoints."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    vit = vitlab.create_model("vit_cifar_tiny_patch4_32")
    (root / "vit").mkdir()
    ckpt.write_model_files(vit, root / "vit", {"task": "classification", "classes": [str(i) for i in range(10)],
                                               "mean": [0.5] * 3, "std": [0.5] * 3}, "vit_cifar_tiny_patch4_32")
    text = vitlab.create_model("transformer_tiny", src_vocab_size=50, tgt_vocab_size=50, share_embeddings=True)
    (root / "text").mkdir()
    ckpt.write_model_files(text, root / "text", {"task": "seq2seq"}, "transformer_tiny")
    return root


def test_onnx_export_of_the_cifar_vit_runs_in_onnxruntime_like_eager(saved, tmp_path):
    path = tmp_path / "vit.onnx"
    main(["export", "--checkpoint", str(saved / "vit"), "--format", "onnx", "--output", str(path)])
    model = vitlab.load_model(saved / "vit")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    for batch in (1, 7):  # the batch dimension is dynamic
        x = torch.randn(batch, 3, 32, 32)
        got = session.run(None, {"images": x.numpy()})[0]
        with torch.no_grad():
            assert np.abs(got - model(x).numpy()).max() <= 1e-4


def test_onnx_export_of_the_text_transformer_with_padding_runs_in_onnxruntime_like_eager(saved, tmp_path):
    model = vitlab.load_model(saved / "text")
    result = export_model(model, tmp_path / "text.onnx", "onnx")
    assert result["max_abs_diff"] <= 1e-4
    session = onnxruntime.InferenceSession(str(tmp_path / "text.onnx"), providers=["CPUExecutionProvider"])
    src, tgt = torch.randint(3, 50, (4, 11)), torch.randint(3, 50, (4, 6))  # other batch and lengths
    src[1, -4:] = model.pad_id
    got = session.run(None, {"src": src.numpy(), "tgt": tgt.numpy()})[0]
    with torch.no_grad():
        assert np.abs(got - model(src, tgt).numpy()).max() <= 1e-4


@pytest.mark.parametrize("name", ["vit", "text"])
def test_torch_export_program_runs_like_eager(saved, tmp_path, name, capsys):
    path = tmp_path / f"{name}.pt2"
    main(["export", "--checkpoint", str(saved / name), "--format", "torch-export", "--output", str(path)])
    assert "differs from the eager model by at most" in capsys.readouterr().out
    model = vitlab.load_model(saved / name)
    program = torch.export.load(str(path)).module()
    inputs = (torch.randn(5, 3, 32, 32),) if name == "vit" else (torch.randint(3, 50, (5, 9)), torch.randint(3, 50, (5, 4)))
    with torch.no_grad():
        assert (program(*inputs) - model(*inputs)).abs().max().item() <= 1e-4


def test_export_refuses_what_it_cannot_do_and_writes_nothing(saved, tmp_path, capsys):
    rnn_dir = tmp_path / "rnn"
    vitlab.create_model("rnn_attention_tiny", src_vocab_size=9, tgt_vocab_size=9).save_pretrained(rnn_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(rnn_dir), "--output", str(tmp_path / "rnn.onnx")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the RNN encoder-decoder cannot be exported" in err
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(saved / "vit"), "--output", str(tmp_path / "no" / "such" / "vit.onnx")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(saved / "vit"), "--format", "torch-export", "--output", str(tmp_path / "x.pt")])
    assert "a torch.export program is a .pt2 file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rnn"]
