#!/bin/bash
# Device sweep: one sim.py process per line of SPEC ("NAME ARGS..."), all at once (one CPU thread each,
# the GPU shared), each stopped after LIMIT seconds; the logs come back as $OUT/logs.tar.gz.
# bash sweep.sh SPEC [LIMIT]
spec=$1; limit=${2:-520}
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
mkdir -p /tmp/sweep
python3 -c "import torch, transformers, pydantic, bm25s, countryinfo; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
while read -r name args; do
  [ -z "$name" ] && continue
  case $name in \#*) continue;; esac
  mkdir -p /tmp/sweep/$name
  timeout $limit python3 benchmarks/results/search_r1/passk_probe/sim.py /tmp/sweep/$name $args > /tmp/sweep/$name/stdout 2>&1 &
done < "$spec"
# partial logs come back even if the call is cut short
( while sleep 20; do tar -C /tmp/sweep -czf $OUT/partial.tar.gz . 2>/dev/null; done ) &
saver=$!
wait $(jobs -p | grep -v "^$saver$")
kill $saver
for d in /tmp/sweep/*/; do echo "== $d"; grep -c . $d/log.jsonl; tail -c 600 $d/stdout | grep -i -m3 error; done
tar -C /tmp/sweep -czf $OUT/logs.tar.gz .
