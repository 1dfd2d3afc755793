"""The same model behind LitServe (Lightning AI's batching server), for benchmarks/bench_serve.py's comparison with
``vitlab serve``: the same reading of the images (:func:`vitlab.serving.uploads.model_images`), the same forward
pass (:class:`vitlab.prediction.BatchPredictor`) and answer, LitServe's own batching (``max_batch_size``,
``batch_timeout`` 5 ms) and workers (one inference process; the API in another). It takes multipart uploads (LitServe
reads a form or JSON).

    python benchmarks/litserve_server.py CHECKPOINT PORT MAX_BATCH_SIZE
"""
from __future__ import annotations

import sys

import litserve as ls
import torch


class VitlabAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        from vitlab.checkpoint import load_model
        from vitlab.inference.forward import cpu_chunk
        from vitlab.prediction import BatchPredictor
        from vitlab.runtime import autocast_dtype

        self.model = load_model(sys.argv[1]).eval()
        cfg = self.model.pretrained_cfg
        self.names = list(cfg["label_names"])
        chunk = cpu_chunk(self.model, tuple(cfg["input_size"]))
        self.predictor = BatchPredictor(self.model, device=torch.device("cpu"),
                                        dtype=autocast_dtype(self.model, "run", torch.device("cpu")), chunk=chunk,
                                        names=self.names)

    def decode_request(self, request):
        from vitlab.serving.uploads import model_images

        upload = request["file"]
        return model_images(self.model, [upload.file.read()], ["file"])[0]

    def batch(self, inputs):
        return torch.stack(inputs)

    def predict(self, x):
        with torch.no_grad():
            return self.predictor.probabilities(x)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, probs):
        from vitlab.serving.app import _answer

        return _answer(probs, self.names, 5, False, None)


if __name__ == "__main__":
    batch = int(sys.argv[3])
    api = VitlabAPI(max_batch_size=batch, batch_timeout=0.005 if batch > 1 else 0.0)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(host="127.0.0.1", port=int(sys.argv[2]),
                                                                    generate_client_file=False)
