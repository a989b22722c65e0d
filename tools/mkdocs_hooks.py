"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``).

Publishes the executed notebooks of ``notebooks/`` with the site, so that ``docs/notebooks.md``
can link to them (as downloadable ``.ipynb`` files) and ``mkdocs build --strict`` checks
those links like any other.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).resolve().parent
    for notebook in sorted((root / "notebooks").glob("*.ipynb")):
        files.append(
            File(
                f"notebooks/{notebook.name}",
                src_dir=str(root),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
