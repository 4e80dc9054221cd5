"""A Hugging Face Hub cache filled as huggingface_hub lays it out, for loading Hub ids offline."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def put_revision(cache: Path, repo: str, source: Path, commit: str, ref: str) -> None:
    """Put every file of ``source`` in the cache as huggingface_hub does: content in blobs/, a link per file in
    snapshots/<commit>/, and refs/<ref> naming the commit."""
    from huggingface_hub import file_download

    storage = cache / file_download.repo_folder_name(repo_id=repo, repo_type="model")
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        blob = storage / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        pointer = Path(file_download._get_pointer_path(str(storage), commit, f.name))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        file_download._create_symlink(str(blob), str(pointer), new_blob=False)
    file_download._cache_commit_hash_for_specific_revision(str(storage), ref, commit)
