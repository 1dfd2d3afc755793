"""save_pretrained / from_pretrained (huggingface_hub's PyTorchModelHubMixin) for every model class, and
vitlab.load_model reading run, checkpoint and save_pretrained directories alike. Local directories only."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab import checkpoint as ckpt
from vitlab.errors import CheckpointError
from vitlab.models import GPT, RNNSeq2Seq, Seq2SeqTransformer, VisionTransformer

MODELS = {
    "vit": (lambda: vitlab.create_model("vit_cifar_tiny_patch4_32", depth=2), lambda: (torch.randn(2, 3, 32, 32),)),
    "transformer": (lambda: vitlab.create_model("transformer_tiny", src_vocab_size=30, tgt_vocab_size=30,
                                                share_embeddings=True),
                    lambda: (torch.randint(3, 30, (2, 7)), torch.randint(3, 30, (2, 5)))),
    "gpt": (lambda: vitlab.create_model("gpt_char_tiny", vocab_size=40), lambda: (torch.randint(0, 40, (2, 9)),)),
    "rnn": (lambda: vitlab.create_model("rnn_attention_tiny", src_vocab_size=30, tgt_vocab_size=30),
            lambda: (torch.randint(3, 30, (2, 7)), torch.randint(3, 30, (2, 5)))),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_save_pretrained_then_from_pretrained_and_load_model_give_the_same_model(name, tmp_path):
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    x = inputs()
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == type(model).__name__
    assert "library_name: vitlab" in (tmp_path / "README.md").read_text()  # the model card's metadata
    # Tied weights are stored once (safetensors refuses shared storage) and tied again on loading.
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert len(stored) == len({p.data_ptr() for p in model.state_dict().values()})
    for loaded in (type(model).from_pretrained(tmp_path), vitlab.load_model(tmp_path)):
        assert type(loaded) is type(model) and not loaded.training
        assert loaded.config == model.config
        with torch.no_grad():
            assert torch.equal(loaded(*x), model(*x))
        if name in ("transformer", "gpt"):
            assert loaded.head.weight is loaded.tgt_embed.weight if name == "transformer" else \
                loaded.head.weight is loaded.tok_embed.weight


def test_the_config_follows_set_input_size_and_reset_classifier(tmp_path):
    model = vitlab.create_model("vit_cifar_tiny_patch4_32")
    model.set_input_size(48)
    model.reset_classifier(5)
    model.save_pretrained(tmp_path)
    loaded = VisionTransformer.from_pretrained(tmp_path)
    assert loaded.patch_embed.img_size == (48, 48) and loaded.head.out_features == 5
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))


def test_from_pretrained_overrides_model_arguments(tmp_path):
    vitlab.create_model("vit_cifar_tiny_patch4_32").save_pretrained(tmp_path)
    model = VisionTransformer.from_pretrained(tmp_path, drop_path_rate=0.1)
    assert model.config["drop_path_rate"] == 0.1 and model.blocks[-1].drop_path1.p == pytest.approx(0.1)


def test_a_trained_checkpoint_keeps_its_classes_normalization_and_tokenizer_through_save_pretrained(tmp_path):
    """The training checkpoint's format and save_pretrained's are one: load_model reads either, and a model
    loaded from a run saves what inference needs (class names, normalization; a text model's tokenizer)."""
    image = vitlab.create_model("vit_cifar_tiny_patch4_32", num_classes=3)
    ckpt.write_model_files(image, tmp_path, {"task": "classification", "classes": ["a", "b", "c"], "mean": [0.5] * 3,
                                             "std": [0.25] * 3}, "vit_cifar_tiny_patch4_32")
    loaded = vitlab.load_model(tmp_path)
    loaded.save_pretrained(tmp_path / "hub")
    again = vitlab.load_model(tmp_path / "hub")
    assert again.pretrained_cfg["label_names"] == ["a", "b", "c"]
    assert again.pretrained_cfg["mean"] == (0.5,) * 3 and again.pretrained_cfg["std"] == (0.25,) * 3

    text = vitlab.create_model("transformer_tiny", src_vocab_size=30, tgt_vocab_size=30)
    (tmp_path / "t").mkdir()
    ckpt.write_model_files(text, tmp_path / "t", {"task": "seq2seq"}, "transformer_tiny")
    (tmp_path / "t" / "tokenizer.json").write_text('{"stand-in": true}')
    Seq2SeqTransformer.from_pretrained(tmp_path / "t").save_pretrained(tmp_path / "t_hub")
    assert (tmp_path / "t_hub" / "tokenizer.json").read_text() == '{"stand-in": true}'
    assert vitlab.load_model(tmp_path / "t_hub").pretrained_cfg["task"] == "seq2seq"


def test_from_pretrained_of_another_class_or_a_broken_directory_is_one_clear_error(tmp_path):
    vitlab.create_model("gpt_char_tiny", vocab_size=10).save_pretrained(tmp_path / "gpt")
    with pytest.raises(CheckpointError, match="describes GPT, not a VisionTransformer; load it with vitlab.load_model"):
        VisionTransformer.from_pretrained(tmp_path / "gpt")
    assert isinstance(vitlab.load_model(tmp_path / "gpt"), GPT)
    (tmp_path / "gpt" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="is corrupt"):
        GPT.from_pretrained(tmp_path / "gpt")
    vitlab.create_model("rnn_attention_tiny", src_vocab_size=9, tgt_vocab_size=9).save_pretrained(tmp_path / "rnn")
    (tmp_path / "rnn" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        RNNSeq2Seq.from_pretrained(tmp_path / "rnn")
