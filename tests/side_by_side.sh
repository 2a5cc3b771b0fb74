#!/bin/sh
# Runs each argument, a lane, at the same time as the others, each writing to a log of its own; then prints the
# logs in order and exits 1 if any command failed. A lane is one or more shell commands separated by ";;", run one
# after another (each whether or not the one before passed). `make test` runs its test groups this way: one run
# alone left a third of 2 cores idle (compilers, servers starting, Python between small calls), and lanes keep
# both cores busy until the last command ends.
logs=$(mktemp -d)
i=0
for lane in "$@"; do
    i=$((i + 1))
    (
        failed=0
        rest="$lane;;"
        while [ -n "$rest" ]; do
            command=${rest%%;;*}; command=${command# }
            rest=${rest#*;;}
            echo "== $command"
            sh -c "$command" || failed=1
        done
        echo $failed > "$logs/$i.rc"
    ) > "$logs/$i.log" 2>&1 &
done
wait
failed=0
i=0
for lane in "$@"; do
    i=$((i + 1))
    cat "$logs/$i.log"
    [ "$(cat "$logs/$i.rc")" = 0 ] || failed=1
done
rm -r "$logs"
exit $failed
