#!/usr/bin/env bash
# Fetches the long evaluation text into models/ (git-ignored): the English Debian
# Administrator's Handbook (Debian package `debian-handbook`, GPL-2+ / CC-BY-SA-3.0),
# its prose paragraphs in the book's order, as plain text. The first 300 000
# characters (~64 000 SmolLM2 tokens) are the evaluation text, the next 30 000 the
# guard's held-out text, and the paragraphs of the 80 000 after those the calibration
# records (JSONL, one `text` record a paragraph): neither calibration nor the guard
# sees what the evaluation scores.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_VERSION="11.20220922"
DEB_SHA256="3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa"
EVAL="models/debian-handbook-eval.txt"
EVAL_SHA256="107d8a72a24ba114438a54f9ecf391b1ec9154eb0aefd1310c4eedd77f579d3f"
GUARD="models/debian-handbook-guard.txt"
GUARD_SHA256="094c382d73f4afbbb1c93a6e94e32f7a0060adb23bfc464ff7c6b368cf548cd4"
CALIB="models/debian-handbook-calib.jsonl"
CALIB_SHA256="18cb1523aa6b0237b174e7ac8bbdbfd1ccf115f9dc3a2b134ce219637ade3526"

mkdir -p models
if echo "$EVAL_SHA256  $EVAL" | sha256sum --check --status 2>/dev/null \
    && echo "$GUARD_SHA256  $GUARD" | sha256sum --check --status 2>/dev/null \
    && echo "$CALIB_SHA256  $CALIB" | sha256sum --check --status 2>/dev/null; then
    echo "$EVAL, $GUARD and $CALIB are present"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
deb="$work/debian-handbook.deb"
if ! (cd "$work" && apt-get download -qq "debian-handbook=$DEB_VERSION" >/dev/null 2>&1); then
    # No package lists yet (a fresh machine): update them, then download.
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    (cd "$work" && apt-get download -qq "debian-handbook=$DEB_VERSION")
fi
mv "$work"/debian-handbook_*.deb "$deb"
if ! echo "$DEB_SHA256  $deb" | sha256sum --check --status; then
    echo "error: the downloaded debian-handbook $DEB_VERSION does not have sha256 $DEB_SHA256" >&2
    exit 1
fi
dpkg-deb -x "$deb" "$work/root"
python3 - "$work/root/usr/share/doc/debian-handbook/html/en-US" "$EVAL.tmp" "$GUARD.tmp" "$CALIB.tmp" <<'PY'
import html.parser, json, os, re, sys

book, eval_out, guard_out, calib_out = sys.argv[1:]
EVAL_CHARS, GUARD_CHARS, CALIB_CHARS = 300_000, 30_000, 80_000


class Paragraphs(html.parser.HTMLParser):
    """The text of every <div class="para">, without code listings or tables."""

    def __init__(self):
        super().__init__()
        self.depth = 0  # <div> nesting inside the current paragraph
        self.skip = 0  # inside <pre>, <table>, <script> or <style>
        self.text = []
        self.paragraphs = []

    def handle_starttag(self, tag, attrs):
        if tag == "div" and (self.depth or ("class", "para") in attrs):
            self.depth += 1
        if tag in ("pre", "table", "script", "style"):
            self.skip += 1

    def handle_endtag(self, tag):
        if tag == "div" and self.depth:
            self.depth -= 1
            if self.depth == 0:
                paragraph = " ".join("".join(self.text).split())
                self.text = []
                if paragraph:
                    self.paragraphs.append(paragraph)
        if tag in ("pre", "table", "script", "style"):
            self.skip -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.text.append(data)


index = open(os.path.join(book, "index.html"), encoding="utf-8").read()
pages = []
for page in re.findall(r'href="([^"#]+\.html)', index):
    if page not in pages and os.path.exists(os.path.join(book, page)):
        pages.append(page)
parser = Paragraphs()
for page in pages:
    parser.feed(open(os.path.join(book, page), encoding="utf-8").read())
text = "\n\n".join(parser.paragraphs)
# Cut at paragraph ends so neither text starts or stops mid-sentence.
eval_end = text.index("\n\n", EVAL_CHARS)
guard_end = text.index("\n\n", eval_end + GUARD_CHARS)
calib_end = text.index("\n\n", guard_end + CALIB_CHARS)
with open(eval_out, "w", encoding="utf-8") as f:
    f.write(text[:eval_end] + "\n")
with open(guard_out, "w", encoding="utf-8") as f:
    f.write(text[eval_end + 2:guard_end] + "\n")
with open(calib_out, "w", encoding="utf-8") as f:
    for paragraph in text[guard_end + 2:calib_end].split("\n\n"):
        f.write(json.dumps({"text": paragraph}) + "\n")
PY
for pair in "$EVAL:$EVAL_SHA256" "$GUARD:$GUARD_SHA256" "$CALIB:$CALIB_SHA256"; do
    file="${pair%%:*}"
    sum="${pair#*:}"
    if ! echo "$sum  $file.tmp" | sha256sum --check --status; then
        echo "error: $file.tmp does not have the expected sha256 $sum" >&2
        sha256sum "$file.tmp" >&2
        exit 1
    fi
    mv "$file.tmp" "$file"
done
echo "fetched $EVAL, $GUARD and $CALIB"
