"""Rebuild stdlib-docstrings.txt: the docstrings of a fixed list of CPython standard-library modules.

Run with the interpreter whose stdlib you want (the shipped file came from CPython 3.11):
    python runtime/shardstack/corpus/make_corpus.py > runtime/shardstack/corpus/stdlib-docstrings.txt
"""

import importlib
import inspect
import sys
import warnings

MODULES = (  # noqa: SIM905 - one readable block
    "abc argparse ast asyncio base64 bisect calendar cmd codecs collections concurrent.futures configparser "
    "contextlib copy csv dataclasses datetime decimal difflib email enum fileinput fnmatch fractions ftplib "
    "functools getopt gettext glob gzip hashlib heapq hmac html http.client http.server imaplib inspect io "
    "ipaddress itertools json logging logging.handlers mailbox math mimetypes multiprocessing numbers operator "
    "optparse os pathlib pdb pickle pkgutil platform plistlib poplib pprint queue random re sched secrets "
    "selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl statistics string struct "
    "subprocess tarfile tempfile textwrap threading timeit tokenize trace traceback turtle typing unittest "
    "urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib"
).split()


def docs(obj, seen: set[int], depth: int = 0):
    doc = inspect.getdoc(obj)
    if doc and id(obj) not in seen:
        seen.add(id(obj))
        yield doc
    if depth >= 2:
        return
    for name, member in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else []:
        if name.startswith("_"):
            continue
        if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(member, "__module__", None) == (
            obj.__name__ if inspect.ismodule(obj) else obj.__module__
        ):
            yield from docs(member, seen, depth + 1)


def main() -> None:
    warnings.simplefilter("ignore")
    seen: set[int] = set()
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # a module missing from this build of Python is simply left out
            continue
        sys.stdout.write(f"\n\n{name}\n{'=' * len(name)}\n\n")
        sys.stdout.write("\n\n".join(docs(mod, seen)) + "\n")


if __name__ == "__main__":
    main()
