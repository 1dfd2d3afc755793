"""The RNN encoder-decoder with Bahdanau attention: its attention against the formula, padding, decoding, the loop."""
from __future__ import annotations

import json

import pytest
import torch

from vitlab import checkpoint as ckpt
from vitlab.config import load_config
from vitlab.models import RNNSeq2Seq
from vitlab.training import train


def _model(score="additive", **kw) -> RNNSeq2Seq:
    torch.manual_seed(0)
    return RNNSeq2Seq(20, 20, embed_dim=16, hidden_dim=32, score=score, **kw).eval()


def test_first_step_attention_is_bahdanaus_formula():
    model = _model()
    src = torch.randint(3, 20, (2, 7))
    src[1, 4:] = 0
    annotations, s0 = model.encode(src, src != 0)
    sc = model.score
    energies = torch.tanh((s0 @ sc.w_q[0])[:, None, :] + annotations @ sc.w_k[0]) @ sc.w_v[0]  # (B, S)
    expected = energies.masked_fill(src == 0, float("-inf")).softmax(-1)
    weights = model.attention_weights(src, torch.full((2, 1), 1))
    torch.testing.assert_close(weights[:, 0], expected)


@pytest.mark.parametrize("score", ["additive", "general", "dot"])
def test_padding_the_source_changes_nothing(score):
    model = _model(score)
    src = torch.randint(3, 20, (2, 6))
    tgt = torch.randint(3, 20, (2, 5))
    padded = torch.cat([src, torch.zeros(2, 3, dtype=torch.long)], 1)
    torch.testing.assert_close(model(padded, tgt), model(src, tgt), rtol=1e-5, atol=1e-6)
    assert (model.attention_weights(padded, tgt)[:, :, 6:] == 0).all()


def test_greedy_is_beam_search_with_one_beam_and_beams_score_at_least_as_well():
    model = _model()
    src = torch.randint(3, 20, (4, 8))
    greedy = model.generate(src, max_new_tokens=12)
    beam = model.generate(src, max_new_tokens=12, beam_size=4, length_penalty=0.0)

    def logp(out):
        total = torch.zeros(4)
        for b in range(4):
            ids = [i for i in out[b].tolist() if i != 0]
            tgt_in = torch.tensor([[1] + ids[:-1]])
            lp = model(src[b:b + 1], tgt_in).log_softmax(-1)[0]
            total[b] = lp[torch.arange(len(ids)), torch.tensor(ids)].sum()
        return total

    assert (logp(beam) >= logp(greedy) - 1e-4).all()  # beam search finds sequences at least as likely


def test_trains_on_the_reverse_task_with_the_transformers_config(tmp_path):
    run_dir = tmp_path / "rnn"
    summary = train(load_config("configs/seq2seq_reverse.yaml", [
        "model.name=rnn_attention_tiny", "data.num_train=640", "data.num_test=32", "data.max_len=8", "train.epochs=2",
        "train.batch_size=32", "train.log_every=5", f"train.output_dir={run_dir}", "optim.lr=3e-3"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert losses[-1] < 0.8 * losses[0]
    assert "val_exact_match" in summary and summary["best_epoch"] is not None
    model = ckpt.load_model(run_dir)
    assert isinstance(model, RNNSeq2Seq) and model.config["score"] == "additive"
