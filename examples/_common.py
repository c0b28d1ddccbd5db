"""What the examples share, so that each shows only its own wiring.

Not part of the library, and on its public API only: scikit-learn's bundled
digits and Python's help topics as bytes (nothing is downloaded), a small
MLP, the command line, a JSON-lines log and the dense-against-one-method
table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

AXIS = "data"


class Split(NamedTuple):
  """The digits, scaled to ``[0, 1]``: 64 features, 10 classes, 20 % held out."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_digits_split(seed: int = 0) -> Split:
  """scikit-learn's 1,797 bundled digits, split stratified (the demo's split)."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=0.2, random_state=seed, stratify=y)
  return Split(x_train, y_train, x_test, y_test)


def digit_images() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """The digits upsampled to MNIST's 28x28x1 for a CNN: train and test ``{"image", "label"}``."""
  split = load_digits_split()
  as_images = lambda x: np.asarray(jax.image.resize(  # noqa: E731
      x.reshape(-1, 8, 8, 1), (len(x), 28, 28, 1), "bilinear"))
  return ({"image": as_images(split.x_train), "label": split.y_train},
          {"image": as_images(split.x_test), "label": split.y_test})


def byte_corpus(max_chars: int = 400_000) -> tuple[np.ndarray, np.ndarray]:
  """Python's help topics as ASCII token ids: train and test (the last 10 %)."""
  from pydoc_data.topics import topics

  text = "\n\n".join(topics[name] for name in sorted(topics))[:max_chars]
  tokens = np.frombuffer(text.encode("ascii", "replace"), np.uint8)
  cut = int(0.9 * len(tokens))
  return tokens[:cut], tokens[cut:]


def windows(tokens: np.ndarray, rng: np.random.Generator, count: int, context: int):
  """``count`` random windows and their next-byte targets, int32 ``[count, context]``."""
  starts = rng.integers(0, len(tokens) - context - 1, count)
  chunk = tokens[starts[:, None] + np.arange(context + 1)].astype(np.int32)
  return chunk[:, :-1], chunk[:, 1:]


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> list[dict[str, jax.Array]]:
  """He-initialised dense layers ``[{"w": [a, b], "b": [b]}, ...]``."""
  layers = []
  for fan_in, fan_out in itertools.pairwise(sizes):
    key, sub = jax.random.split(key)
    layers.append({"w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
                   "b": jnp.zeros((fan_out,))})
  return layers


def mlp_logits(layers: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  """ReLU MLP; the last layer is linear."""
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ layers[-1]["w"] + layers[-1]["b"]


def worker_mesh() -> jax.sharding.Mesh:
  """A 1-D ``("data",)`` mesh over every device: one worker per device."""
  return jax.make_mesh((jax.device_count(),), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,))


def example_parser(description: str, default_out: str) -> argparse.ArgumentParser:
  """The command line every digits example shares (dense vs one method)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", default="exdyna", help="compared with dense")
  parser.add_argument("--batch-per-worker", type=int, default=32)
  parser.add_argument("--learning-rate", type=float, default=0.1)
  parser.add_argument("--momentum", type=float, default=None,
                      help="none by default: optax.sgd(lr, momentum=0.0) still keeps a trace")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(default_out))
  return parser


def port_parser(description: str) -> argparse.ArgumentParser:
  """The command line of the Flax MNIST ports, as Flax's single-device script has it."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--eval-every", type=int, default=100)
  parser.add_argument("--batch-size", type=int, default=64, help="global, over all workers")
  parser.add_argument("--learning-rate", type=float, default=0.005)
  parser.add_argument("--momentum", type=float, default=0.9)
  parser.add_argument("--seed", type=int, default=0)
  return parser


def write_json_lines(path: pathlib.Path, records: Sequence[dict[str, Any]]) -> None:
  """One JSON object per line: the per-step metrics of a run."""
  path.write_text("".join(json.dumps(record) + "\n" for record in records))


def example_row(method: str, accuracy: float, losses: Sequence[float], hlo_bytes: int,
                stats_bytes: int) -> dict[str, Any]:
  """One row of an example's table: HLO bytes are `exdyna_jax.hlo`'s count of the step."""
  return {
      "method": method,
      "test_accuracy": f"{accuracy:.2%}",
      "first_loss": f"{losses[0]:.3f}",
      "last_loss": f"{np.mean(losses[-10:]):.3f}",
      "bytes/worker/step (HLO)": hlo_bytes,
      "(stats)": stats_bytes,
  }


def compare(train: Callable[[str], dict[str, Any]], method: str,
            out: pathlib.Path) -> list[dict[str, Any]]:
  """Trains ``dense`` and ``method``, prints the table and writes it to ``out``."""
  out.mkdir(parents=True, exist_ok=True)
  rows = [train(name) for name in ("dense", method)]
  cells = [list(rows[0]), *[[str(value) for value in row.values()] for row in rows]]
  widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
  lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
           for line in cells]
  table = "\n".join([lines[0], "  ".join("-" * width for width in widths), *lines[1:]])
  print(table)
  (out / "table.txt").write_text(table + "\n")
  return rows


def digits_example(description: str, default_out: str, train: Callable[..., dict[str, Any]],
                   argv: Sequence[str] | None) -> list[dict[str, Any]]:
  """The ``main`` of the digits examples: their command line, dense vs one method.

  ``train(method, args, mesh, split, out_dir)`` trains one method and returns
  its `example_row`.
  """
  args = example_parser(description, default_out).parse_args(argv)
  mesh, split = worker_mesh(), load_digits_split()
  return compare(lambda method: train(method, args, mesh, split, args.out), args.method, args.out)
