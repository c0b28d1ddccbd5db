"""Real data that ships with installed packages: nothing is downloaded.

- `load_digits_split`: scikit-learn's bundled 8x8 handwritten digits
  (1,797 images, 10 classes); `digit_images` upsamples them to MNIST's 28x28.
- `char_corpus`: English text that ships with Python itself (the help topics
  of ``pydoc_data``, falling back to the docstrings of standard modules),
  encoded as bytes for a character-level language model; `code_corpus`:
  the Python source of standard modules, the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from typing import NamedTuple

import numpy as np

# Standard modules with long docstrings: the fallback corpus when pydoc_data is
# missing (some distributions strip it).
_DOCSTRING_MODULES = (
    "argparse", "collections", "csv", "datetime", "decimal", "difflib", "email",
    "fractions", "functools", "heapq", "inspect", "itertools", "json", "logging",
    "pathlib", "pickle", "random", "re", "shutil", "statistics", "string",
    "subprocess", "textwrap", "threading", "typing", "unittest", "zipfile",
)  # fmt: skip


class Split(NamedTuple):
  """A train/test split of a classification data set.

  Attributes:
    x_train: float32 ``[n_train, features]``.
    y_train: int32 ``[n_train]`` labels.
    x_test: float32 ``[n_test, features]``.
    y_test: int32 ``[n_test]`` labels.
    num_classes: number of labels.
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> Split:
  """scikit-learn's bundled digits, scaled to ``[0, 1]``, split stratified.

  Args:
    test_fraction: share of the 1,797 images held out for testing.
    seed: seed of the split.

  Returns:
    The `Split` (64 features, 10 classes).
  """
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=test_fraction, random_state=seed, stratify=y
  )
  return Split(x_train, y_train, x_test, y_test, 10)


def digit_images() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """The digits as MNIST-sized images for a CNN: ``({"image", "label"}, ...)``, train and test.

  Returns:
    Train and test dicts: ``image`` float32 ``[n, 28, 28, 1]`` in ``[0, 1]``
    (the 8x8 digits upsampled bilinearly), ``label`` int32 ``[n]``.
  """
  import jax

  split = load_digits_split()
  as_images = lambda x: np.asarray(jax.image.resize(  # noqa: E731
      x.reshape(-1, 8, 8, 1), (len(x), 28, 28, 1), "bilinear"))
  return ({"image": as_images(split.x_train), "label": split.y_train},
          {"image": as_images(split.x_test), "label": split.y_test})


def _stdlib_text() -> str:
  try:
    from pydoc_data.topics import topics
  except ImportError:
    topics = {}
  if topics:
    return "\n\n".join(topics[name] for name in sorted(topics))
  docs = []
  for name in _DOCSTRING_MODULES:
    try:
      module = importlib.import_module(name)
    except ImportError:
      continue
    docs.append(module.__doc__ or "")
  return "\n\n".join(docs)


class CharCorpus(NamedTuple):
  """A byte-level corpus with a train/test split.

  Attributes:
    train: uint8 ``[n_train]`` token ids (ASCII bytes; others become ``?``).
    test: uint8 ``[n_test]`` token ids, the last part of the text.
    vocab_size: 128 (ASCII).
  """

  train: np.ndarray
  test: np.ndarray
  vocab_size: int


def char_corpus(max_chars: int | None = 400_000, test_fraction: float = 0.1) -> CharCorpus:
  """English text shipped with Python, as ASCII token ids.

  Args:
    max_chars: keep at most this many characters (``None``: all, about
      0.5 M with ``pydoc_data``).
    test_fraction: share of the text (its end) held out for testing.

  Returns:
    The `CharCorpus`.
  """
  return _as_corpus(_stdlib_text(), max_chars, test_fraction)


def code_corpus(max_chars: int | None = 400_000, test_fraction: float = 0.1) -> CharCorpus:
  """Python source code that ships with Python (standard modules), as ASCII token ids.

  A second corpus for the language-model benchmark, of another kind than
  `char_corpus`'s English prose.

  Args:
    max_chars: keep at most this many characters (``None``: all).
    test_fraction: share of the text (its end) held out for testing.

  Returns:
    The `CharCorpus`.
  """
  sources = []
  for name in _DOCSTRING_MODULES:
    try:
      path = importlib.util.find_spec(name).origin
      sources.append(pathlib.Path(path).read_text(encoding="utf-8", errors="replace"))
    except (AttributeError, ImportError, OSError, TypeError):
      continue
  return _as_corpus("\n\n".join(sources), max_chars, test_fraction)


def _as_corpus(text: str, max_chars: int | None, test_fraction: float) -> CharCorpus:
  if max_chars is not None:
    text = text[:max_chars]
  tokens = np.frombuffer(text.encode("ascii", errors="replace"), np.uint8).copy()
  tokens[tokens >= 128] = ord("?")
  split = int(len(tokens) * (1 - test_fraction))
  return CharCorpus(tokens[:split], tokens[split:], 128)


def sample_windows(
    tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
  """Random windows of ``tokens`` and the next-character targets.

  Args:
    tokens: uint8 ``[T]`` token ids.
    rng: the random generator.
    batch: number of windows.
    length: characters per window.

  Returns:
    ``(inputs, targets)``: int32 ``[batch, length]`` each, ``targets`` shifted
    by one character.
  """
  starts = rng.integers(0, len(tokens) - length - 1, batch)
  windows = tokens[starts[:, None] + np.arange(length + 1)].astype(np.int32)
  return windows[:, :-1], windows[:, 1:]
