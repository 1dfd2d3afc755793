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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.fixture(scope="module")
def calibrated(saved, tmp_path_factory):
    """The tiny ViT with a temperature (what vitlab calibrate keeps) and class names with a space."""
    root = tmp_path_factory.mktemp("calibrated")
    vit = vitlab.load_model(saved / "vit")
    (root / "vit").mkdir()
    names = ["stop sign", *(f"class {i}" for i in range(1, 10))]
    ckpt.write_model_files(vit, root / "vit", {"task": "classification", "classes": names, "mean": [0.4, 0.5, 0.6],
                                               "std": [0.2, 0.25, 0.3], "temperature": 1.7}, "vit_cifar_tiny_patch4_32")
    assert vitlab.load_model(root / "vit").pretrained_cfg["temperature"] == 1.7
    return root / "vit"


@pytest.mark.slow
def test_with_preprocess_takes_uint8_images_and_gives_vitlab_predicts_probabilities(calibrated, tmp_path):
    import json

    from PIL import Image

    model = vitlab.load_model(calibrated)
    rng = np.random.default_rng(0)
    files = []
    for i in range(5):
        files.append(tmp_path / f"image {i}.png")
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(files[-1])
    main(["predict", "--checkpoint", str(calibrated), "--output", str(tmp_path / "p.jsonl"), "--topk", "10",
          "--num-workers", "0", "--precision", "no", *map(str, files)])
    predicted = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    path = tmp_path / "vit.onnx"
    main(["export", "--checkpoint", str(calibrated), "--output", str(path), "--with-preprocess"])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()[0]
    assert (inputs.name, inputs.type, inputs.shape[1:]) == ("images", "tensor(uint8)", [32, 32, 3])
    pixels = np.stack([np.asarray(Image.open(f)) for f in files])
    probs = session.run(None, {"images": pixels})[0]
    for row, p in zip(predicted, probs):
        order = np.argsort(-p)
        assert [model.pretrained_cfg["label_names"][k] for k in order] == row["classes"]
        assert np.allclose(p[order], row["probs"], atol=1e-6)  # the temperature applied inside
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(meta["vitlab.label_names"])[0] == "stop sign" and meta["vitlab.temperature"] == "1.7"
    assert meta["vitlab.input"] == "uint8 RGB (batch, 32, 32, 3)"
    # int8: the matrix products' weights quantized, the norms, adds and softmax in float
    quantized = tmp_path / "vit.int8.onnx"
    main(["export", "--checkpoint", str(calibrated), "--output", str(quantized), "--with-preprocess", "--quantize",
          "int8"])
    ops = {n.op_type for n in onnx.load(str(quantized)).graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear", "LayerNormalization", "Add", "Softmax"} <= ops
    assert quantized.stat().st_size < 0.5 * path.stat().st_size
    int8 = onnxruntime.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])
    assert np.abs(int8.run(None, {"images": pixels})[0] - probs).max() < 0.05
    meta = {p.key: p.value for p in onnx.load(str(quantized)).metadata_props}
    assert "vitlab.label_names" in meta


def test_with_preprocess_and_quantize_refuse_what_they_cannot_do(saved, tmp_path):
    from vitlab.errors import ConfigError

    text = vitlab.load_model(saved / "text")
    with pytest.raises(ConfigError, match="--with-preprocess puts an image classifier's preprocessing"):
        export_model(text, tmp_path / "t.onnx", with_preprocess=True)
    with pytest.raises(ConfigError, match="--quantize int8 quantizes an ONNX file"):
        export_model(vitlab.load_model(saved / "vit"), tmp_path / "v.pt2", "torch-export", quantize="int8")
    assert list(tmp_path.iterdir()) == []
