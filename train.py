"""Train with Hugging Face Accelerate: a ViT on CIFAR-10 or your images, a text Transformer (task: seq2seq) or a
language model (task: lm). The same as ``vitlab train``; the other commands (eval, calibrate, predict, embed,
attention, translate, sample, export, shards, models): ``vitlab --help``.

    python train.py --config configs/vit_cifar10.yaml [key.sub=value ...]
    python train.py --resume runs/vit_cifar10 [train.epochs=300]   # continue a run, changed on purpose
    (the same --config command again continues its run: train.resume=auto)
    accelerate launch --multi_gpu --num_processes 2 train.py --config ...
"""
from vitlab.cli import train_main

if __name__ == "__main__":
    train_main()
