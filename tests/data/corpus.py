"""A small corpus and a tiny BPE vocabulary shared by the data tests."""

# Merges of the tiny BPE vocabulary, ranked after the 256 single bytes, each reachable by merging
# two lower-ranked tokens.
TINY_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"\xc3\xa9"]
CORPUS = {
    "a.txt": "The first document.\nIt has two lines.\n",
    "notes/b.md": "# Zweites Dokument\n\nUmlaute: äöü, and 世界 🎉.\n",
    "notes/c.jsonl": '{"text": "third document", "id": 3}\n\n{"text": "fourth, after a blank line"}\n',
    "notes/deeper/d.json": '[{"text": "fifth, from a JSON array"}, {"text": ""}, {"text": "sixth"}]',
    "notes/skipped.csv": "not,a,data,file\n",
    ".hidden/e.txt": "hidden files are skipped\n",
}
# The documents above in the order a directory read yields them (sorted paths; the empty one dropped).
CORPUS_DOCUMENTS = [
    "The first document.\nIt has two lines.\n",
    "# Zweites Dokument\n\nUmlaute: äöü, and 世界 🎉.\n",
    "third document",
    "fourth, after a blank line",
    "fifth, from a JSON array",
    "sixth",
]


def write_files(root, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
