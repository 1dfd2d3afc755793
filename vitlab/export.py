"""Export a trained model for deployment: ONNX (``torch.onnx.export``, the ``torch.export``-based
exporter) or a ``torch.export`` program (``.pt2``), with a dynamic batch size (and dynamic lengths for
text), checked against the eager model before the file is put in place.

What is exported is the model's ``forward``:

================== ============================================ =====================================
model              inputs                                       output
================== ============================================ =====================================
VisionTransformer, ``images`` float32 ``(batch, C, H, W)``,      ``logits`` ``(batch, classes)``
TimmClassifier     normalised as ``model.pretrained_cfg`` says
Seq2SeqTransformer ``src`` int64 ``(batch, src_len)``,           ``logits`` ``(batch, tgt_len, vocab)``
                   ``tgt`` int64 ``(batch, tgt_len)`` (teacher   (padding = ``pad_id`` is masked)
                   forcing; decode step by step by growing tgt)
GPT                ``idx`` int64 ``(batch, len <= block_size)``  ``logits`` ``(batch, len, vocab)``
================== ============================================ =====================================

The RNN encoder-decoder is not exportable: its packed GRU and its step loop depend on the sentence
lengths, which ``torch.export`` cannot trace symbolically.

``with_preprocess`` (an image classifier): the file takes what a deployment has, ``images`` uint8 RGB
``(batch, H, W, 3)`` at the training size, normalizes them inside as training did, and returns ``probabilities``
(softmax at the run's temperature; a multi-label run's sigmoids); its metadata (ONNX ``metadata_props``; a ``.pt2``'s
``vitlab.json``) carries the label names, the thresholds, the temperature, the input layout. A model calibrated for
images of none of its classes (``vitlab calibrate --unknown``) by a score of :data:`GRAPH_SCORES` (its logits',
``msp``, ``max_logit``, ``energy``, or one of a few fixed matrices of its pooled features, ``vim`` and the Mahalanobis
scores, which the file holds) also returns ``unknown_score`` ``(batch,)``, and the metadata its threshold and label
(``vitlab.unknown``: an image is unknown below it); the k-NN score's bank (every training image's features) stays out
of the file, which the result's ``unknown`` line says. ``quantize='int8'``
(ONNX): onnxruntime's dynamic quantization of the matrix products' weights (``MatMul``, ``Gemm``), the norms, residual
adds, softmax and the patch embedding's convolution kept in float32.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.export import Dim

from .errors import CheckpointError, ConfigError
from .models import GPT, RNNSeq2Seq, Seq2SeqTransformer
from .inference.forward import logits_and_features
from .inference.open_set import LOGIT_SCORES, stored_rule
from .models.hub import image_input_size

__all__ = ["export_model", "example_inputs", "PreprocessedClassifier", "FORMATS", "GRAPH_SCORES"]

FORMATS = ("onnx", "torch-export")
# the unknown scores an exported file computes: of the logits, or of the pooled features by a few matrices whose size
# is the width's (ViM's origin and residual subspace, the Mahalanobis means and precision), not the training set's
GRAPH_SCORES = (*LOGIT_SCORES, "vim", "mahalanobis", "relative_mahalanobis")


class PreprocessedClassifier(nn.Module):
    """``model`` (an image classifier) behind its preprocessing: uint8 RGB ``(B, H, W, 3)`` -> probabilities
    ``(B, classes)``, normalized as :func:`vitlab.data.transforms.normalize` does (the same operations), at the
    temperature of ``model.pretrained_cfg``; sigmoids for a multi-label model. With an unknown threshold of a score of
    :data:`GRAPH_SCORES` kept for the weights: (probabilities, ``unknown_score`` ``(B,)``), the score of the raw logits
    or of the pooled features (computed as ``vitlab predict`` does, in float64, by what the calibration fitted)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.pretrained_cfg
        self.model, self.multi_label = model, bool(cfg.get("multi_label"))
        self.temperature = float(cfg.get("temperature", 1.0))
        device = next(model.parameters()).device  # what the wrapper adds lives where the weights do
        self.unknown = stored_rule(cfg) if (cfg.get("unknown") or {}).get("score") in GRAPH_SCORES else None
        if self.unknown is not None and self.unknown.fitted is not None:
            self.unknown.fitted.load_state({k: v.to(device) for k, v in self.unknown.fitted.state().items()})
        for name in ("mean", "std"):
            values = torch.tensor([v * 255 for v in cfg[name]], device=device).view(-1, 1, 1)
            self.register_buffer(name, values, persistent=False)

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        x = (images.permute(0, 3, 1, 2).to(torch.float32) - self.mean) / self.std
        if self.unknown is not None and self.unknown.needs_features:
            logits, features = (t.float() for t in logits_and_features(self.model, x))
        else:
            logits = self.model(x).float()
        probs = logits.sigmoid() if self.multi_label else (logits / self.temperature).softmax(-1)
        if self.unknown is None:
            return probs
        if self.unknown.needs_features:
            return probs, self.unknown.fitted(features).float()
        return probs, LOGIT_SCORES[self.unknown.score](logits)

    def metadata(self) -> dict[str, str]:
        """What a deployment reads beside the file, as strings (JSON for lists)."""
        cfg = self.model.pretrained_cfg
        return {"vitlab.label_names": json.dumps(list(cfg.get("label_names") or [])),
                "vitlab.thresholds": json.dumps(cfg.get("thresholds")), "vitlab.temperature": str(self.temperature),
                "vitlab.multi_label": json.dumps(self.multi_label),
                "vitlab.input": f"uint8 RGB (batch, {cfg['input_size'][1]}, {cfg['input_size'][2]}, 3)",
                "vitlab.output": "sigmoids" if self.multi_label else "softmax probabilities at the temperature",
                **({"vitlab.unknown": json.dumps({"score": self.unknown.score, "threshold": self.unknown.threshold,
                                                  "below": "unknown"})} if self.unknown else {})}


def example_inputs(model: nn.Module) -> tuple[tuple[Tensor, ...], tuple[dict[int, Dim], ...], list[str]]:
    """Example inputs of ``model.forward``, their dynamic dimensions and names (batch 2)."""
    batch = Dim("batch", min=1, max=65536)
    device = next(model.parameters()).device
    if isinstance(model, PreprocessedClassifier):
        c, h, w = image_input_size(model.model)
        return (torch.randint(0, 256, (2, h, w, c), dtype=torch.uint8, device=device),), ({0: batch},), ["images"]
    if image_input_size(model) is not None:
        c, h, w = image_input_size(model)
        return (torch.randn(2, c, h, w, device=device),), ({0: batch},), ["images"]
    if isinstance(model, Seq2SeqTransformer):
        longest = model.pos_encoding.shape[0]
        src_len, tgt_len = Dim("src_len", min=2, max=longest), Dim("tgt_len", min=2, max=longest)
        vocab_src, vocab_tgt = model.src_embed.num_embeddings, model.tgt_embed.num_embeddings
        special = max(model.pad_id, model.bos_id, model.eos_id) + 1
        src = torch.randint(special, max(vocab_src, special + 1), (2, 7), device=device)
        tgt = torch.randint(special, max(vocab_tgt, special + 1), (2, 5), device=device)
        return (src, tgt), ({0: batch, 1: src_len}, {0: batch, 1: tgt_len}), ["src", "tgt"]
    if isinstance(model, GPT):
        length = Dim("len", min=2, max=model.block_size)
        idx = torch.randint(0, model.vocab_size, (2, min(8, model.block_size)), device=device)
        return (idx,), ({0: batch, 1: length},), ["idx"]
    if isinstance(model, RNNSeq2Seq):
        raise ConfigError("the RNN encoder-decoder cannot be exported: its packed GRU and step loop depend on the "
                          "sentence lengths, which torch.export cannot trace; export a Transformer instead")
    raise ConfigError(f"cannot export a {type(model).__name__}")


def _check_inputs(model: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Inputs of another batch size (and lengths) than the example's, with padding for a text model."""
    if isinstance(model, PreprocessedClassifier):
        return (torch.randint(0, 256, (3, *args[0].shape[1:]), dtype=torch.uint8, device=args[0].device),)
    if image_input_size(model) is not None:
        return (torch.randn(3, *args[0].shape[1:], device=args[0].device),)
    grown = tuple(torch.cat([a, a[:1]], 0) for a in args)
    if isinstance(model, Seq2SeqTransformer):
        src = torch.cat([grown[0], grown[0][:, :3]], 1)
        src[0, -2:] = model.pad_id  # a padded sentence
        return src, grown[1]
    return grown


def export_model(model: nn.Module, output: str | Path, format: Literal["onnx", "torch-export"] = "onnx",
                 check: bool = True, with_preprocess: bool = False, quantize: str | None = None) -> dict[str, Any]:
    """Export ``model`` (in eval mode) to ``output``; returns what was written and how closely it agrees.

    With ``check`` the exported file is loaded again (``onnxruntime`` for ONNX, ``torch.export.load``)
    and run on inputs of another batch size than the example's; ``max_abs_diff`` is its largest
    difference from the eager model. The file is written under a temporary name and renamed into
    place, so a failed export leaves nothing behind. A model with LoRA adapters is exported merged
    (:func:`~vitlab.models.lora.merged_copy`: plain linear layers, the same outputs; the model given keeps its
    adapters). ``with_preprocess``, ``quantize``: see the module.
    """
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r} is not one of {', '.join(FORMATS)}")
    output = Path(output)
    if not output.parent.is_dir():
        raise ConfigError(f"--output {str(output)!r}: the folder {str(output.parent)!r} does not exist")
    if format == "torch-export" and output.suffix != ".pt2":
        raise ConfigError(f"--output {str(output)!r}: a torch.export program is a .pt2 file (torch.export.load "
                          f"expects the suffix); name it {output.stem}.pt2")
    if quantize not in (None, "int8"):
        raise ConfigError(f"--quantize {quantize!r}: int8 is the one quantization vitlab export makes")
    if quantize and format != "onnx":
        raise ConfigError("--quantize int8 quantizes an ONNX file (onnxruntime's dynamic quantization): add "
                          "--format onnx")
    if with_preprocess and (image_input_size(model) is None or not model.pretrained_cfg.get("label_names")):
        raise ConfigError(f"--with-preprocess puts an image classifier's preprocessing in the file; "
                          f"{type(model).__name__} is not one with class names")
    from .models.lora import merged_copy

    model = merged_copy(model).eval()  # LoRA adapters folded in, on a copy
    if with_preprocess:
        model = PreprocessedClassifier(model).eval()
    args, dynamic, names = example_inputs(model)
    outputs = ["probabilities" if with_preprocess else "logits"]
    if with_preprocess and model.unknown is not None:
        outputs.append("unknown_score")
    tmp = output.with_name(f".{output.stem}.tmp{'.pt2' if format == 'torch-export' else output.suffix}")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporters' deprecation and tracing chatter
            if format == "onnx":
                torch.onnx.export(model, args, str(tmp), input_names=names, output_names=outputs,
                                  dynamic_shapes=dynamic, dynamo=True, external_data=False, verbose=False)
                if with_preprocess or quantize:
                    _finish_onnx(tmp, model.metadata() if with_preprocess else {}, quantize)
            else:
                extra = {"vitlab.json": json.dumps(model.metadata())} if with_preprocess else None
                torch.export.save(torch.export.export(model, args, dynamic_shapes=dynamic), str(tmp),
                                  extra_files=extra)
        result: dict[str, Any] = {"output": str(output), "format": format, "inputs": names, "outputs": outputs}
        score = (model.model.pretrained_cfg.get("unknown") or {}).get("score") if with_preprocess else None
        if score and model.unknown is None:  # k-NN: its bank grows with the training set
            result["unknown"] = (f"the {score} score is not in the file: its bank is every training image's features, "
                                 f"kept beside the weights (vitlab predict and serve use it); calibrate one of "
                                 f"{', '.join(GRAPH_SCORES)} for a file that says unknown")
        if check:
            result["max_abs_diff"] = _max_abs_diff(model, tmp, format, _check_inputs(model, args), names)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return result


def _finish_onnx(path: Path, metadata: dict[str, str], quantize: str | None) -> None:
    """The ONNX file at ``path`` with ``metadata`` in its ``metadata_props``, and quantized (see the module)."""
    import onnx

    if quantize:
        try:
            from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic
        except ImportError:
            raise ConfigError("--quantize int8 needs onnxruntime: pip install 'vitlab[export]'") from None
        prepared, quantized = (path.with_name(path.stem + suffix + path.suffix) for suffix in (".pre", ".int8"))
        try:
            # shapes inferred and the graph optimized, as onnxruntime asks; by onnx's shape inference alone:
            # onnxruntime's symbolic one cannot read a ReduceL2 whose axes are an input (opset 18: ViM's norm), and a
            # plain model's quantized file gives the same outputs either way
            quant_pre_process(str(path), str(prepared), skip_symbolic_shape=True)
            quantize_dynamic(str(prepared), str(quantized), weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul", "Gemm"])
            os.replace(quantized, path)
        finally:
            prepared.unlink(missing_ok=True)
            quantized.unlink(missing_ok=True)
    if metadata:
        proto = onnx.load(str(path))
        for key, value in metadata.items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(proto, str(path))


def _max_abs_diff(model: nn.Module, path: Path, format: str, inputs: tuple[Tensor, ...], names: list[str]) -> float:
    """The largest difference of the file's outputs (each of them) from the eager model's."""
    with torch.no_grad():
        expected = model(*inputs)
    expected = [t.float().cpu() for t in (expected if isinstance(expected, tuple) else (expected,))]
    if format == "onnx":
        try:
            import onnxruntime
        except ImportError:
            raise CheckpointError("checking the ONNX file needs onnxruntime: pip install 'vitlab[export]' "
                                  "(or pass check=False / --no-check)") from None
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = [torch.from_numpy(a) for a in session.run(None, {n: x.cpu().numpy() for n, x in zip(names, inputs)})]
    else:
        with torch.no_grad():
            out = torch.export.load(str(path)).module()(*inputs)
        got = [t.float().cpu() for t in (out if isinstance(out, (tuple, list)) else (out,))]
    assert len(got) == len(expected), f"the file gives {len(got)} outputs, the model {len(expected)}"
    return max((g - e).abs().max().item() for g, e in zip(got, expected))
