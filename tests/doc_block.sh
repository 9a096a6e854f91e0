# doc_block DOC NAME LANG: prints the fenced ```LANG block of the Markdown file DOC that follows
# the first line naming NAME (a file the doc shows verbatim, e.g. examples/slurm/c10d.sbatch), or
# nothing. Sourced by the tests that check such copies (tests/slurm/slurm.sh, tests/container/
# podman_test.sh): `diff FILE <(doc_block DOC NAME LANG)`.
doc_block() {
  awk -v name="$2" -v fence="\`\`\`$3" '
    index($0, name) && !inside { armed = 1; next }
    armed && $0 == fence { inside = 1; armed = 0; next }
    inside && /^```$/ { exit }
    inside { print }' "$1"
}
