"""Distillation (DeiT): the loss against DeiT's formula written out here, on random tensors; a student
hard-distilled from a teacher vitlab trained, whose checkpoints hold no teacher and resume exactly; a
bad teacher in one line before any data is read."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import reset_accelerate, tiny_overrides, train_until_signal
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.tasks.distill import DistillationLoss
from vitlab.training import train


class _Teacher(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@pytest.mark.parametrize("kind", ["soft", "hard"])
@pytest.mark.parametrize("two_heads", [True, False])
def test_the_loss_is_deits_formula(kind, two_heads):
    # DeiT's losses.py: (1 - alpha) * base + alpha * distill; soft: KL of the temperature-scaled
    # log-softmaxes (log_target) summed, times tau^2, over the number of elements; hard: cross-entropy
    # to the teacher's argmax. The distillation head is the second output, or the one head.
    torch.manual_seed(0)
    teacher, inputs = _Teacher().eval(), torch.randn(8, 12)
    logits, logits_dist = torch.randn(8, 5, requires_grad=True), torch.randn(8, 5, requires_grad=True)
    labels = torch.randint(0, 5, (8,))
    alpha, tau = 0.3, 2.5
    loss = DistillationLoss(torch.nn.CrossEntropyLoss(), teacher, kind, alpha, tau)
    got = loss((logits, logits_dist) if two_heads else logits, inputs, labels)
    student = logits_dist if two_heads else logits
    with torch.no_grad():
        t = teacher(inputs)
    if kind == "soft":
        log_p, log_q = F.log_softmax(student / tau, dim=1), F.log_softmax(t / tau, dim=1)
        distill = (log_q.exp() * (log_q - log_p)).sum() * tau * tau / student.numel()
    else:
        distill = F.cross_entropy(student, t.argmax(dim=1))
    expected = (1 - alpha) * F.cross_entropy(logits, labels) + alpha * distill
    torch.testing.assert_close(got, expected)
    got.backward()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher is frozen, no gradients


@pytest.fixture(scope="module")
def teacher_run(tiny_imagefolder, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("teacher") / "run"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ACCELERATE_USE_CPU", "true")
        train(load_config(None, tiny_overrides(tiny_imagefolder, run_dir, "train.epochs=1")))
    reset_accelerate()
    return run_dir


def test_a_student_distilled_from_a_vitlab_run_keeps_no_teacher_and_resumes_bit_identical(
        teacher_run, tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    keys = ("model.distilled=true", "distill.type=hard", f"distill.teacher={teacher_run}",
            "train.epochs=2", "data.augment=randaugment", "data.mixup_alpha=0.2")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *keys)))
    reset_accelerate()
    assert summary["epochs_done"] == 2
    weights = load_file(str(whole / "checkpoints/last/model.safetensors"))
    assert "dist_token" in weights and "head_dist.weight" in weights
    assert not any(k.startswith(("teacher", "_teacher")) for k in weights)
    card = json.loads((whole / "checkpoints/last/config.json").read_text())
    assert card["distilled_from"] == str(teacher_run) and card["distill"] == "hard"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, parts, *keys))
    train_until_signal(monkeypatch, cfg, 8)
    train(cfg)
    resumed = load_file(str(parts / "checkpoints/last/model.safetensors"))
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_a_bad_teacher_is_one_line_before_any_data_is_read(tiny_imagefolder, tmp_path, teacher_run):
    with pytest.raises(ConfigError, match=r"^distill.type=hard needs distill.teacher"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "a", "distill.type=hard"))
    with pytest.raises(ConfigError, match=r"^distill.teacher='/nowhere' is neither timm:<name> nor a vitlab run"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "b", "distill.type=soft",
                                               "distill.teacher=/nowhere")))
    reset_accelerate()
    import vitlab

    five = tmp_path / "five"
    vitlab.create_model("vit_cifar_tiny_patch4_32", num_classes=5).save_pretrained(five)
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*five' gives 5 classes, the data 3: a teacher is trained "
                                          r"on the student's classes"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "c", "distill.type=soft",
                                               f"distill.teacher={five}")))


IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # timm's IMAGENET_DEFAULT_MEAN / _STD, written out


def test_the_teacher_sees_the_batch_in_its_own_normalization(tmp_path):
    """A teacher trained on other statistics than the run's (ImageNet's, under a run normalized with
    CIFAR-10's) is given the student's batch re-normalized to its own: the logits it gives the same
    pixels normalized its way. With the run's statistics it is the teacher as loaded, unwrapped."""
    import timm
    from safetensors.torch import save_file

    import vitlab
    from vitlab.data.transforms import CIFAR10_MEAN, CIFAR10_STD, normalize
    from vitlab.tasks.distill import load_teacher

    torch.manual_seed(0)
    pixels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    run_input = normalize(pixels, CIFAR10_MEAN, CIFAR10_STD)  # the batch the student sees
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=1, embed_dim=32, num_heads=2, num_classes=3)
    model.pretrained_cfg = {"input_size": (3, 32, 32), "mean": IMAGENET[0], "std": IMAGENET[1]}
    model.save_pretrained(tmp_path / "vit")  # its config.json says ImageNet's statistics
    reference = vitlab.load_model(tmp_path / "vit")
    teacher = load_teacher(str(tmp_path / "vit"), "", 3, "cpu", CIFAR10_MEAN, CIFAR10_STD)
    torch.testing.assert_close(teacher(run_input), reference(normalize(pixels, *IMAGENET)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reference(run_input), reference(normalize(pixels, *IMAGENET)), atol=1e-3)  # it matters
    same = load_teacher(str(tmp_path / "vit"), "", 3, "cpu", *IMAGENET)
    assert type(same) is type(reference) and torch.equal(same(normalize(pixels, *IMAGENET)),
                                                         reference(normalize(pixels, *IMAGENET)))

    # timm's weights (a local copy, no config.json beside it): timm's pretrained_cfg says how they were trained.
    convnet = timm.create_model("test_resnet", num_classes=3).eval()
    save_file(convnet.state_dict(), str(tmp_path / "resnet.safetensors"))
    theirs = convnet.pretrained_cfg
    teacher = load_teacher("timm:test_resnet", str(tmp_path / "resnet.safetensors"), 3, "cpu", CIFAR10_MEAN, CIFAR10_STD)
    torch.testing.assert_close(teacher(run_input), convnet(normalize(pixels, theirs["mean"], theirs["std"])),
                               rtol=1e-5, atol=1e-5)


def test_data_mean_and_std_normalize_the_run_and_stay_with_it(tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    """data.mean / data.std (timm's --mean / --std) are the run's normalization: its checkpoints keep them
    (load_model's pretrained_cfg), other statistics give other weights, and a resume refuses a change."""
    import vitlab

    own = ("data.mean=[0.5,0.5,0.5]", "data.std=[0.25,0.25,0.25]")
    runs = {}
    for name, keys in {"default": (), "own": own}.items():
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / name, "train.epochs=1", *keys)))
        reset_accelerate()
        runs[name] = load_file(str(tmp_path / name / "checkpoints/last/model.safetensors"))
    model = vitlab.load_model(tmp_path / "own")
    assert model.pretrained_cfg["mean"] == (0.5, 0.5, 0.5) and model.pretrained_cfg["std"] == (0.25, 0.25, 0.25)
    assert vitlab.load_model(tmp_path / "default").pretrained_cfg["mean"] == (0.4914, 0.4822, 0.4465)  # CIFAR-10's
    assert not all(torch.equal(runs["own"][k], runs["default"][k]) for k in runs["own"])
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "cut", *own))
    train_until_signal(monkeypatch, cfg, 3)
    other = load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "cut", "data.mean=[0.4,0.5,0.5]", own[1]))
    with pytest.raises(ConfigError, match=r"holds a run with another config \(data.mean: '\[0.5, 0.5, 0.5\]' there"):
        train(other)
    # --resume allows changing keys on purpose (more epochs), but not the statistics the run trained on.
    with pytest.raises(ConfigError, match=r"^data.mean=\[0.4, 0.5, 0.5\] differs from the run's \[0.5, 0.5, 0.5\]"):
        train(other, resume=tmp_path / "cut")
    reset_accelerate()


def test_a_timm_distilled_deit_as_the_student_trains_its_distillation_head_on_the_teacher(
        teacher_run, tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    # As the vitlab preset does (model.distilled=true): timm's VisionTransformerDistilled in distilled training
    # returns (head, head_dist); the class term acts on the first, the distillation term on the second.
    import timm

    from vitlab.models import TimmClassifier
    from vitlab.tasks import distill

    small = dict(num_classes=3, img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2)
    model = TimmClassifier("deit_tiny_distilled_patch16_224", **small)
    assert model.distilled
    reference = timm.create_model("deit_tiny_distilled_patch16_224", **small)
    reference.load_state_dict(model.state_dict())
    model.set_distilled_training(True)
    reference.set_distilled_training(True)
    x = torch.randn(2, 3, 32, 32)
    head, head_dist = model.train()(x)
    theirs = reference.train()(x)
    assert torch.equal(head, theirs[0]) and torch.equal(head_dist, theirs[1]) and not torch.equal(head, head_dist)
    assert not TimmClassifier("test_vit", num_classes=3).distilled

    outputs_seen = []
    original = distill.DistillationLoss.forward

    def recording(self, outputs, inputs, labels):
        outputs_seen.append(isinstance(outputs, tuple) and len(outputs) == 2)
        return original(self, outputs, inputs, labels)

    monkeypatch.setattr(distill.DistillationLoss, "forward", recording)
    overrides = [o for o in tiny_overrides(tiny_imagefolder, tmp_path / "student", "train.epochs=1")
                 if not o.startswith(("model.name", "model.depth", "model.embed_dim", "model.num_heads"))]
    train(load_config(None, overrides + ["model.name=timm:deit_tiny_distilled_patch16_224", "model.img_size=32",
                                         "model.patch_size=8", "model.depth=1", "model.embed_dim=32",
                                         "model.num_heads=2", "distill.type=hard", f"distill.teacher={teacher_run}"]))
    assert outputs_seen and all(outputs_seen)


def test_a_teacher_built_for_another_input_size_is_one_line_before_any_image_is_decoded(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    import vitlab
    from vitlab.data.split import SplitIndex

    big = tmp_path / "teacher64"
    vitlab.create_model("vit_cifar_tiny_patch4_32", img_size=64, depth=1, embed_dim=32, num_heads=2,
                        num_classes=3).save_pretrained(big)

    def no_decoding(*args, **kwargs):
        raise AssertionError("images were decoded before the teacher was checked")

    monkeypatch.setattr(SplitIndex, "load", no_decoding)
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*teacher64' takes 64 x 64 images and the student's are "
                                          r"32 x 32 .*train the teacher at the student's size"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "s", "distill.type=hard",
                                               f"distill.teacher={big}")))
