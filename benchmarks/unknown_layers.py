"""Unknown images by every layer's features: the Mahalanobis and k-NN scores (the shared covariance, k 50, as
``vitlab.inference.open_set``'s) on the class token and on the mean of the patch tokens after the patch embedding and
after each block, each alone and summed after z-scoring on the run's validation images (Lee et al. 2018's feature
ensemble, without their logistic regression fitted on unknown images), and the default score (ViM) joined with a
layer's score by their p-values on the validation images (Fisher's sum of logs, and the weighted Bonferroni minimum
``min(p_vim / (1 - w), p_layer / w)``, as Haroush et al. 2022 join layers), and k-NN joined so with the relative
Mahalanobis score; and two more scores of the last layer, NNGuide (Park et al. 2023: the energy times the mean
cosine similarity to the 10 nearest training features, each scaled by its own energy, as its authors' code) and GEN
(Liu et al. 2023: minus the generalized entropy of the softmax, gamma 0.1, over every class); and three that need only
the linear head and the training features' mean or spread, by pytorch-ood's code where it has them: fDBD (Liu & Qin
2024: the mean distance to the decision boundaries of the predicted class over the distance to the training features'
mean, or, as OpenOOD also sweeps, over the feature's norm), DICE (Sun & Li 2022: the energy of a head with the 90% of
weight x mean-activation contributions that are smallest set to zero) and ViM's residual alone (minus the norm outside
the principal subspace); and ODIN (Liang et al. 2018: the maximum softmax at temperature 1000 of the image moved
0.0014 against the gradient of its predicted class's loss, pytorch-ood's preprocessing, OpenOOD's CIFAR values, no
tuning on unknown images). AUROC on the run's test
split against a folder of unknown images (the open-set split's 4 classes) and a far-from-the-data folder
(``make_unknown_images.py``), by its subfolders too. A measurement, not a score of the package (issue 74).

    python benchmarks/unknown_layers.py --checkpoint /tmp/osr/run0 --unknown /tmp/osr/unknown0 --far /tmp/unknown \\
        --output run0_layers.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from vitlab.checkpoint import resolve_checkpoint
from vitlab.config import load_config
from vitlab.data.transforms import ModelInput
from vitlab.inference.forward import gathered, logits_and_features
from vitlab.inference.open_set import KNNScore, MahalanobisScore, ViMScore, auroc, energy, msp
from vitlab.inference.view import model_dataset
from vitlab.models.registry import load_model
from vitlab.prediction import files_index, list_images
from vitlab.tasks.classification.evaluation import classifier_split


def layer_features(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """``(B, K + E + 2 (L + 1) E)``: the logits, the pooled features, then for the patch embedding's output and each
    of the L blocks' the class token and the mean of the patch tokens."""
    tokens = []
    hooks = [model.blocks[0].register_forward_pre_hook(lambda m, a: tokens.append(a[0]))]
    hooks += [b.register_forward_hook(lambda m, a, o: tokens.append(o)) for b in model.blocks]
    try:
        logits, pooled = logits_and_features(model, images)
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = [part for t in tokens for part in (t[:, 0], t[:, 1:].mean(1))]
    return torch.cat([logits, pooled, *per_layer], 1).float()


def odin_score(model: torch.nn.Module, images: torch.Tensor, temperature: float = 1000.0, eps: float = 0.0014
               ) -> torch.Tensor:
    """``(B, 1)``: ODIN's maximum softmax at ``temperature`` of the normalized ``images`` moved by pytorch-ood's
    ``odin_preprocessing`` (``eps`` in the scale of pixels in [0, 1])."""
    from pytorch_ood.detector.odin import odin_preprocessing

    moved = odin_preprocessing(model, images, eps=eps, temperature=temperature,
                               norm_std=list(model.pretrained_cfg["std"]))
    return (model(moved) / temperature).softmax(dim=1).amax(dim=1, keepdim=True).float()


def folder(model: torch.nn.Module, model_input: ModelInput, accelerator: Any, root: str, compute: Any = layer_features
           ) -> tuple[torch.Tensor, np.ndarray]:
    """``compute`` (:func:`layer_features`) of the images below ``root`` (read as ``vitlab eval --unknown-images``
    reads them) and the name of the folder under ``root`` each lies in."""
    files = list_images([root])
    groups = np.array([Path(f).relative_to(root).parts[0] for f in files])
    loader = DataLoader(model_dataset(model, files_index(model, files)), batch_size=256)
    return gathered(model, loader, accelerator, compute, model_input)[0], groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--unknown", required=True, help="folder of unknown images near the data (class folders)")
    parser.add_argument("--far", required=True, help="folder of far-from-the-data images (group folders)")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()
    directory = resolve_checkpoint(args.checkpoint)
    cfg = load_config(directory / "run_config.yaml", (), recorded=True)
    model = load_model(directory).eval()
    info = model.pretrained_cfg
    model_input = ModelInput(info["mean"], info["std"])

    def split(name: str, compute: Any = layer_features) -> tuple[Any, torch.Tensor, torch.Tensor]:
        accelerator, loader, _, _, _ = classifier_split(directory, cfg, model, name, 256)
        return accelerator, *gathered(model, loader, accelerator, compute, model_input)

    (_, train, labels), (_, val, _), (accelerator, test, _) = split("train"), split("val"), split("test")
    unknown, _ = folder(model, model_input, accelerator, args.unknown)
    far, groups = folder(model, model_input, accelerator, args.far)
    c, e, layers = len(info["label_names"]), model.embed_dim, len(model.blocks) + 1
    names = ["pooled"] + [f"{kind}{j}" for j in range(layers) for kind in ("cls", "mean")]

    def parts(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": x[:, :c], **{name: x[:, c + i * e: c + (i + 1) * e] for i, name in enumerate(names)}}

    sets = {"val": parts(val), "test": parts(test), "unknown": parts(unknown), "far": parts(far)}
    train_parts = parts(train)
    results = {}

    def rate(name, score) -> None:
        s = {k: score(v) for k, v in sets.items()}
        row = {"open_set": auroc(s["test"], s["unknown"]), "far": auroc(s["test"], s["far"])}
        row.update({g: auroc(s["test"], s["far"][torch.from_numpy(groups == g)]) for g in sorted(set(groups))})
        results[name] = row

    rate("msp", lambda d: msp(d["logits"]))
    maha = {n: MahalanobisScore().fit(train_parts[n], labels) for n in names if n != "cls0"}  # cls0: one vector
    knns = {n: KNNScore(50).fit(train_parts[n]) for n in maha}
    for n in maha:
        rate(f"mahalanobis_{n}", lambda d, n=n: maha[n](d[n]))
        rate(f"knn_{n}", lambda d, n=n: knns[n](d[n]))

    def ensemble(keys: list[str]):
        val_scores = {n: maha[n](sets["val"][n]) for n in keys}
        return lambda d: sum((maha[n](d[n]) - val_scores[n].mean()) / val_scores[n].std() for n in keys)

    means = [f"mean{j}" for j in range(layers)]
    rate("ensemble_means", ensemble(means))
    rate("ensemble_pooled_and_means", ensemble(["pooled", *means]))
    every_layer = ensemble(["pooled", *[f"cls{j}" for j in range(1, layers)], *means])
    rate("ensemble_all", every_layer)

    vim = ViMScore(model.head.weight, model.head.bias).fit(train_parts["pooled"])
    relative = MahalanobisScore(relative=True).fit(train_parts["pooled"], labels)
    vim_score, relative_score = (lambda d: vim(d["pooled"])), (lambda d: relative(d["pooled"]))
    rate("vim", vim_score)
    rate("relative_mahalanobis_pooled", relative_score)

    def p_value(score):
        """The share of validation images scoring at or below an image's score, (1 + count) / (N + 1): small is
        unusual."""
        ranked = score(sets["val"]).double().sort().values
        return lambda d: (1 + torch.searchsorted(ranked, score(d).double(), right=True)) / (len(ranked) + 1)

    p_vim = p_value(vim_score)
    layer_scores = {f"mahalanobis_{n}": lambda d, n=n: maha[n](d[n]) for n in ("cls1", "mean2")}
    layer_scores["ensemble_all"] = every_layer
    for name, score in layer_scores.items():
        p_layer = p_value(score)
        rate(f"fisher_vim_{name}", lambda d, p=p_layer: p_vim(d).log() + p(d).log())
        for w in (0.5, 0.2, 0.1, 0.05):
            rate(f"minp_vim_{name}_w{w}", lambda d, p=p_layer, w=w: torch.minimum(p_vim(d) / (1 - w), p(d) / w))
    p_knn, p_relative = p_value(lambda d: knns["pooled"](d["pooled"])), p_value(relative_score)
    rate("fisher_knn_relative_mahalanobis", lambda d: p_knn(d).log() + p_relative(d).log())

    # NNGuide as its authors' code: unit features, the bank's scaled by their energy, k 10
    bank = torch.nn.functional.normalize(train_parts["pooled"], dim=1) * energy(train_parts["logits"])[:, None]

    def nnguide(d: dict[str, torch.Tensor]) -> torch.Tensor:
        unit = torch.nn.functional.normalize(d["pooled"], dim=1)
        return (unit @ bank.T).topk(10, dim=1).values.mean(dim=1) * energy(d["logits"])

    def gen(d: dict[str, torch.Tensor]) -> torch.Tensor:
        p = d["logits"].softmax(dim=1)
        return -(p ** 0.1 * (1 - p) ** 0.1).sum(dim=1)

    rate("nnguide", nnguide)
    rate("gen", gen)

    from pytorch_ood.detector import DICE, fDBD  # a test extra of vitlab; scores are minus pytorch-ood's outlier scores
    head = model.head.float()
    torch.testing.assert_close(head(train_parts["pooled"][:256]), train_parts["logits"][:256], rtol=1e-4, atol=1e-4)
    fdbd = fDBD(None, head).fit_features(train_parts["pooled"])
    rate("fdbd", lambda d: -fdbd.predict_features(d["pooled"]))
    # the feature's norm instead of its distance to the training mean: the outlier score times distance / norm
    rate("fdbd_norm", lambda d: -fdbd.predict_features(d["pooled"]) * (d["pooled"] - fdbd.train_mean).norm(dim=1)
         / d["pooled"].norm(dim=1))
    dice = DICE(None, head.weight, head.bias, p=0.9).fit_features(train_parts["pooled"], labels)
    rate("dice", lambda d: -dice.predict_features(d["pooled"]))
    rate("vim_residual", lambda d: -((d["pooled"].double() - vim.origin) @ vim.residual).norm(dim=1))

    # ODIN needs the images again (a backward pass each), not the features
    odin = {"test": split("test", odin_score)[1], "unknown": folder(model, model_input, accelerator, args.unknown,
                                                                     odin_score)[0],
            "far": folder(model, model_input, accelerator, args.far, odin_score)[0]}
    odin = {k: v[:, 0] for k, v in odin.items()}
    results["odin"] = {"open_set": auroc(odin["test"], odin["unknown"]), "far": auroc(odin["test"], odin["far"]),
                       **{g: auroc(odin["test"], odin["far"][torch.from_numpy(groups == g)])
                          for g in sorted(set(groups))}}
    for name, row in results.items():
        print(f"{name:28s} " + " ".join(f"{k} {100 * v:6.2f}" for k, v in row.items()))
    args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
