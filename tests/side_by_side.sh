#!/bin/sh
# Runs each argument, a shell command, at the same time as the others, each writing to a log of its own; then
# prints the logs in order and exits 1 if any command failed. `make test` runs its test groups this way: one
# run alone left a third of 2 cores idle (compilers, servers starting, Python between small calls).
logs=$(mktemp -d)
i=0
for command in "$@"; do
    i=$((i + 1))
    (sh -c "$command" > "$logs/$i.log" 2>&1; echo $? > "$logs/$i.rc") &
done
wait
failed=0
i=0
for command in "$@"; do
    i=$((i + 1))
    echo "== $command"
    cat "$logs/$i.log"
    [ "$(cat "$logs/$i.rc")" = 0 ] || failed=1
done
rm -r "$logs"
exit $failed
