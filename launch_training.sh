#!/usr/bin/env bash
# Launch ddp_training.py under torchrun on this machine: GPUs with NCCL, or CPU processes with gloo.
# The configuration is validated first, without torch.distributed, so a mistake exits 2 with one
# line per problem instead of a traceback from every rank.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: ./launch_training.sh [options] [-- ddp_training.py flags]

  -g, --gpus IDS            GPUs to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES; one process each)
      --cpu                 train on CPU with gloo; hides every GPU (CUDA_VISIBLE_DEVICES="")
  -n, --nproc N             processes: with --cpu (default 2), or the first N GPUs of a GPU host
  -b, --batch-size N        per-rank micro-batch size
  -e, --epochs N            number of epochs
  -l, --log-dir DIR         logs, TensorBoard events, summary.json
  -c, --checkpoint-dir DIR  checkpoints and the final model
      --config FILE         a .toml or .json config file
      --data PATH           synthetic, a .txt file or a .bin uint16 token file
      --test                a tiny model and dataset that trains in seconds
      --debug               DEBUG logs, faulthandler, NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG
      --doctor              run only the DDP preflight on every rank and print its report
      --max-restarts N      restart the worker group up to N times after a failure (torchrun);
                            each restart resumes from the newest valid checkpoint
      --heal                heal in place (recovery.heal=in_place): each rank is a torchrun job of
                            its own; when one dies (or a whole node), the others go on at once in
                            their processes, and its restart (--max-restarts) rejoins them at a
                            step's end. On N nodes: --nnodes N --node-rank R --rdzv-endpoint H:P,
                            where node 0 (host H) serves the run's store on port P
      --node-rank R         with --heal on N nodes: this node's place, 0 to N-1 (node 0 hosts the
                            run's store; its loss ends the run, a restart resumes from the checkpoint)
      --spares K            with --heal: K of the processes (--nproc, or --gpus: the last K ids) wait,
                            model and datasets built, and step in at once for a lost rank (default 0)
      --nnodes N|MIN:MAX    number of nodes (multi-node, with --rdzv-endpoint and --rdzv-id); a range
                            is elastic: with --max-restarts, the run continues on the nodes left
                            after a node is lost (the global batch kept), and grows back when a
                            node rejoins
      --rdzv-endpoint H:P   the rendezvous endpoint, the same on every node: the host of the c10d
                            store (one of the nodes), or an etcd server (etcd-v2)
      --rdzv-backend B      c10d (default: the store lives in one node's agent, and the job ends
                            with that node) or etcd-v2 (an etcd server that no training node owns;
                            needs python-etcd, and a fresh --rdzv-id for each launch)
      --rdzv-id ID          a run id, the same on every node
      --rdzv-join-timeout S how long a rendezvous waits for --nnodes (the minimum) to join: at the
                            start, and after a failure (default 60)
      --rdzv-last-call S    with a range, how long a rendezvous that has its minimum waits for more
                            nodes (default 5)
      --rdzv-rejoin-timeout S
                            with a fixed --nnodes N > 1, how long the run waits for a lost node to
                            rejoin before it ends with 75 (default 15; the first rendezvous waits
                            --rdzv-join-timeout)
  -h, --help                this help

With neither --gpus nor --cpu, all visible GPUs are used, or 2 CPU processes if there is none.
Inside a SLURM allocation (run once per node through srun), the node count, the rendezvous endpoint
(the first host of the node list, a port from the job id), the run id (the job id and its requeue
count) and, on a CPU partition, one process per allocated CPU come from SLURM unless given here.
Under Kubeflow (PET_* variables), torchrun takes the nodes, processes and rendezvous from PET_*:
the launcher passes none of its own.
Everything after -- is passed to ddp_training.py (see: python ddp_training.py --help).
Relative paths (options, flags after --, DDP_* variables, values in the config file) are relative
to the current directory, as with python ddp_training.py; --test writes to runs/test/ there.
The exit code is torchrun's, except: 0 after a preemption that saved, 2 for an invalid
configuration, 75 when a node of the run was lost (relaunch to resume; docs/clusters.md).
EOF
}

die() { echo "launch_training.sh: $*" >&2; exit 2; }

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }

# Prints nothing when torch cannot be imported.
gpu_count() { "$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || true; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
gpus="" cpu=0 nproc="" test_mode=0 debug=0 heal=0 spares=0 node_rank=""
max_restarts="" nnodes="" rdzv_endpoint="" rdzv_id="" rdzv_backend=c10d join_timeout=60 last_call=5 rejoin_timeout=15
train_args=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    -g|--gpus) need_value "$@"; gpus="$2"; shift 2 ;;
    --cpu) cpu=1; shift ;;
    -n|--nproc) need_value "$@"; nproc="$2"; shift 2 ;;
    -b|--batch-size) need_value "$@"; train_args+=(--data.batch_size "$2"); shift 2 ;;
    -e|--epochs) need_value "$@"; train_args+=(--train.num_epochs "$2"); shift 2 ;;
    -l|--log-dir) need_value "$@"; train_args+=(--logging.dir "$2"); shift 2 ;;
    -c|--checkpoint-dir) need_value "$@"; train_args+=(--checkpoint.dir "$2"); shift 2 ;;
    --config) need_value "$@"; train_args+=(--config "$2"); shift 2 ;;
    --data) need_value "$@"; train_args+=(--data.source "$2"); shift 2 ;;
    --test) test_mode=1; shift ;;
    --debug) debug=1; shift ;;
    --doctor) train_args+=(--doctor); shift ;;
    --max-restarts) need_value "$@"; max_restarts="$2"; shift 2 ;;
    --heal) heal=1; shift ;;
    --spares) need_value "$@"; spares="$2"; shift 2 ;;
    --node-rank) need_value "$@"; node_rank="$2"; shift 2 ;;
    --nnodes) need_value "$@"; nnodes="$2"; shift 2 ;;
    --rdzv-endpoint) need_value "$@"; rdzv_endpoint="$2"; shift 2 ;;
    --rdzv-id) need_value "$@"; rdzv_id="$2"; shift 2 ;;
    --rdzv-backend) need_value "$@"; rdzv_backend="$2"; shift 2 ;;
    --rdzv-join-timeout) need_value "$@"; join_timeout="$2"; shift 2 ;;
    --rdzv-last-call) need_value "$@"; last_call="$2"; shift 2 ;;
    --rdzv-rejoin-timeout) need_value "$@"; rejoin_timeout="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; train_args+=("$@"); break ;;
    *) die "unknown option '$1' (see --help; flags for ddp_training.py go after --)" ;;
  esac
done

[[ -n "$gpus" && $cpu -eq 1 ]] && die "--gpus and --cpu exclude each other"
[[ -z "$nproc" || "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc '$nproc': must be a positive integer"
[[ -z "$max_restarts" || "$max_restarts" =~ ^[0-9]+$ ]] ||
  die "--max-restarts '$max_restarts': must be a non-negative integer"

# Where this runs: a Kubeflow job's pod (torchrun reads PET_*), a SLURM allocation, or a host.
platform=host
if [[ -n "${PET_NNODES:-}${PET_MASTER_ADDR:-}${PET_RDZV_ENDPOINT:-}" ]]; then
  platform=kubernetes
elif [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
  platform=slurm
fi
if [[ $platform == kubernetes ]]; then
  [[ -z "$nnodes$rdzv_endpoint$rdzv_id" ]] ||
    die "--nnodes/--rdzv-endpoint/--rdzv-id: under Kubeflow (PET_* set) torchrun takes them from PET_NNODES, PET_RDZV_ENDPOINT or PET_MASTER_ADDR/PORT, and PET_RDZV_ID"
  nnodes=${PET_NNODES:-1}
  [[ -n "$nproc" || ! "${PET_NPROC_PER_NODE:-}" =~ ^[1-9][0-9]*$ ]] || nproc=$PET_NPROC_PER_NODE
elif [[ $platform == slurm && -z "$nnodes" ]]; then
  # The step's nodes under srun (an srun may use fewer nodes than the job has), else the job's.
  nnodes=${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
  node_list=${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}
  if [[ $nnodes -gt 1 ]]; then
    if [[ -z "$rdzv_endpoint" ]]; then
      # The whole list, then its first line (head(1) closing the pipe early would fail pipefail).
      head_node=$(scontrol show hostnames "$node_list") ||
        die "SLURM: 'scontrol show hostnames $node_list' failed; pass --rdzv-endpoint HOST:PORT"
      head_node=${head_node%%$'\n'*}
      [[ -n "$head_node" ]] || die "SLURM: no host in the node list '$node_list'; pass --rdzv-endpoint HOST:PORT"
      # A port from the job id, the same on every node: 20000-39999.
      rdzv_endpoint="$head_node:$(( 20000 + SLURM_JOB_ID % 20000 ))"
    fi
    # A requeued job is a new launch: a rendezvous of its own.
    rdzv_id=${rdzv_id:-slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}}
  fi
fi
nnodes=${nnodes:-1}
max_restarts_flag=(--max-restarts "${max_restarts:-0}")
if [[ $platform == kubernetes && -z "$max_restarts" && -n "${PET_MAX_RESTARTS:-}" ]]; then
  max_restarts_flag=()  # torchrun reads PET_MAX_RESTARTS
fi
[[ "$nnodes" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] ||
  die "--nnodes '$nnodes': must be a positive integer N or a range MIN:MAX"
min_nodes=${nnodes%%:*} max_nodes=${nnodes##*:}
[[ $min_nodes -le $max_nodes ]] || die "--nnodes $nnodes: MIN must not exceed MAX"
[[ "$rdzv_backend" == c10d || "$rdzv_backend" == etcd-v2 ]] ||
  die "--rdzv-backend '$rdzv_backend': allowed: c10d, etcd-v2"
[[ "$join_timeout" =~ ^[1-9][0-9]*$ ]] || die "--rdzv-join-timeout '$join_timeout': must be a positive integer"
[[ "$last_call" =~ ^[1-9][0-9]*$ ]] || die "--rdzv-last-call '$last_call': must be a positive integer"
[[ "$rejoin_timeout" =~ ^[1-9][0-9]*$ ]] ||
  die "--rdzv-rejoin-timeout '$rejoin_timeout': must be a positive integer"
[[ "$spares" =~ ^[0-9]+$ ]] || die "--spares '$spares': must be a non-negative integer"
[[ $spares -eq 0 || $heal -eq 1 ]] || die "--spares: only with --heal (a spare steps in for a rank lost in place)"
STOPPED_GRACE_S=${HEAL_STOPPED_GRACE_S:-10}
[[ "$STOPPED_GRACE_S" =~ ^[1-9][0-9]*$ ]] || die "HEAL_STOPPED_GRACE_S='$STOPPED_GRACE_S': must be a positive integer (seconds)"
[[ $heal -eq 0 || $platform == host ]] ||
  die "--heal: outside SLURM and Kubeflow for now (docs/fault-tolerance.md, Heal in place)"
[[ $heal -eq 0 || $min_nodes -eq $max_nodes ]] ||
  die "--heal --nnodes $nnodes: a fixed node count (the lost capacity rejoins in place, not through a range)"
if [[ $heal -eq 1 && $max_nodes -gt 1 ]]; then
  [[ "$node_rank" =~ ^[0-9]+$ && $node_rank -lt $max_nodes ]] ||
    die "--heal --nnodes $nnodes needs --node-rank R, R from 0 to $(( max_nodes - 1 )) (node 0 hosts the run's store)"
  [[ $spares -eq 0 ]] || die "--spares: one node for now (with --heal --nnodes $nnodes, every process trains)"
  [[ "${rdzv_endpoint##*:}" =~ ^[1-9][0-9]*$ ]] ||
    die "--heal --nnodes $nnodes: --rdzv-endpoint '$rdzv_endpoint' needs a port (node 0 serves the run's store there)"
else
  [[ -z "$node_rank" || "$node_rank" == 0 ]] ||
    die "--node-rank $node_rank: only with --heal on several nodes (torchrun's c10d rendezvous ignores it)"
  node_rank=0
fi
if [[ $max_nodes -gt 1 && $platform != kubernetes ]]; then
  [[ "$rdzv_endpoint" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]] || die "--nnodes $nnodes needs --rdzv-endpoint HOST:PORT"
  [[ "$rdzv_id" =~ ^[A-Za-z0-9._-]+$ ]] || die "--nnodes $nnodes needs --rdzv-id ID (letters, digits, . _ -)"
fi

if [[ -n "$gpus" ]]; then
  [[ "$gpus" =~ ^(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*$ ]] ||
    die "--gpus '$gpus': must be a comma-separated list of GPU ids, e.g. 0,1"
  [[ -z "$nproc" ]] || die "--nproc is for --cpu; with --gpus there is one process per GPU"
  IFS=, read -r -a gpu_list <<< "$gpus"
  seen=,
  for id in "${gpu_list[@]}"; do
    [[ $seen != *",$id,"* ]] || die "--gpus $gpus: GPU $id is listed twice; each GPU takes one process"
    seen+="$id,"
  done
  # The ids index the host's GPUs: they replace the caller's CUDA_VISIBLE_DEVICES.
  visible=$(unset CUDA_VISIBLE_DEVICES; gpu_count)
  [[ -n "$visible" ]] || die "--gpus $gpus: cannot count GPUs: $python cannot import torch"
  [[ $visible -gt 0 ]] ||
    die "--gpus $gpus: no CUDA GPU is visible on this host (torch.cuda.device_count() = 0); use --cpu"
  for id in "${gpu_list[@]}"; do
    [[ $id -lt $visible ]] || die "--gpus $gpus: GPU $id does not exist; allowed: 0 to $(( visible - 1 ))"
  done
  export CUDA_VISIBLE_DEVICES="$gpus"
  nproc=${#gpu_list[@]}
elif [[ $cpu -eq 0 ]]; then
  visible=$(gpu_count)
  if [[ "$visible" =~ ^[1-9][0-9]*$ ]]; then
    # A GPU host: --nproc N trains on its first N GPUs (it never switches to CPU unasked).
    [[ -z "$nproc" || $nproc -le $visible ]] ||
      die "--nproc $nproc: this host has $visible GPU(s); use --nproc 1 to $visible, --gpus IDS, or --cpu for CPU processes"
    nproc=${nproc:-$visible}
  else
    cpu=1
  fi
fi
if [[ $cpu -eq 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
  if [[ -z "$nproc" && $platform == slurm && "${SLURM_CPUS_ON_NODE:-}" =~ ^[1-9][0-9]*$ ]]; then
    nproc=$SLURM_CPUS_ON_NODE  # a CPU partition: one process per allocated CPU
  fi
  nproc=${nproc:-2}
  train_args=(--ddp.backend gloo "${train_args[@]}")
  # getconf, not nproc(1): nproc obeys OMP_NUM_THREADS.
  cores=${SLURM_CPUS_ON_NODE:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}
  threads=$(( cores / nproc ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
fi

if [[ $test_mode -eq 1 ]]; then
  train_args=(--model.vocab_size 64 --model.hidden_size 64 --model.num_layers 2 --model.num_heads 2
              --model.seq_len 32 --model.dropout 0 --data.synthetic_size 2048 --data.batch_size 16
              --data.num_workers 0 --optim.lr 3e-3 --optim.warmup_steps 5 --train.max_steps 60
              --logging.interval 10 --eval.interval 0 --checkpoint.resume none --logging.dir runs/test/logs
              --checkpoint.dir runs/test/checkpoints "${train_args[@]}")
fi

[[ $heal -eq 0 ]] || train_args=(--recovery.heal in_place "${train_args[@]}")

if [[ $max_nodes -eq 1 && $platform != kubernetes ]]; then
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
  export MASTER_ADDR=127.0.0.1
fi
if [[ $debug -eq 1 ]]; then
  train_args+=(--debug)
  export NCCL_DEBUG=INFO CUDA_LAUNCH_BLOCKING=1 TORCH_SHOW_CPP_STACKTRACES=1 PYTHONFAULTHANDLER=1
  # torch 2.13 segfaults in DDP's constructor under DETAIL on gloo; DETAIL is safe only with NCCL.
  if [[ $cpu -eq 1 ]]; then
    export TORCH_DISTRIBUTED_DEBUG=INFO
  else
    export TORCH_DISTRIBUTED_DEBUG=DETAIL
  fi
fi

[[ $spares -lt $nproc ]] || die "--spares $spares: must be fewer than the $nproc processes (the rest train)"
# WORLD_SIZE: the check refuses data that cannot fill one global batch of every rank.
checkpoint_dir=$(WORLD_SIZE=$(( (nproc - spares) * max_nodes )) "$python" "$here/ddp_training.py" --check-config "${train_args[@]}") ||
  exit $?

nproc_flag=(--nproc-per-node "$nproc")
if [[ $platform == kubernetes ]]; then
  # torchrun reads PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT and
  # PET_RDZV_*: a flag here would override what the job's controller set.
  rdzv=()
  [[ -z "${PET_NPROC_PER_NODE:-}" ]] || nproc_flag=()
  pet_backend=${PET_RDZV_BACKEND:-c10d}
  if [[ -n "${PET_RDZV_ENDPOINT:-}" && ( $pet_backend == c10d || $pet_backend == etcd-v2 ) &&
        ( $min_nodes -lt $max_nodes || $pet_backend == etcd-v2 ) ]]; then
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # see the range below
    export RDZV_STORE_ENDPOINT="$pet_backend://$PET_RDZV_ENDPOINT"
  fi
elif [[ $max_nodes -gt 1 ]]; then
  # A lost node is dropped from the rendezvous after keep_alive_interval x keep_alive_max_attempt
  # (6 s) without a heartbeat, instead of 15 s. A worker that sees a node go exits 75, so the
  # surviving agents take torchrun's failure path at once (docs/fault-tolerance.md, Node loss).
  rdzv=(--nnodes "$nnodes" --rdzv-backend "$rdzv_backend" --rdzv-endpoint "$rdzv_endpoint" --rdzv-id "$rdzv_id"
        --rdzv-conf "join_timeout=$join_timeout,last_call_timeout=$last_call,keep_alive_interval=2,keep_alive_max_attempt=3")
  if [[ $min_nodes -lt $max_nodes || $rdzv_backend == etcd-v2 ]]; then
    # torch 2.13's shared agent store cannot admit a node into a running job (the newcomer waits
    # forever for bootstrap keys of an earlier round), and under etcd it would live in the node of
    # rank 0: off, and the workers agree on their restart in the rendezvous's own store
    # instead (framework/ddp/process_group.py, RDZV_STORE_ENV).
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 RDZV_STORE_ENDPOINT="$rdzv_backend://$rdzv_endpoint"
  fi
else
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  rdzv=(--nnodes 1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --local-addr 127.0.0.1)
fi

# The traps are in place before torchrun starts, so no signal finds the script without them.
# torchrun forwards SIGTERM/SIGINT to its workers, which save a checkpoint and write PREEMPTED, and
# then exits 1 itself. SIGUSR1 and SIGHUP (an ssh drop) reach it as SIGTERM: torchrun does not handle
# SIGUSR1 (it would die and leave its workers running) and passes SIGHUP on to the workers, which do
# not save on it. A signal that comes before torchrun's pid is known is sent once it is.
children=() pending="" signalled=0 store_pid=""
# shellcheck disable=SC2329  # called by the traps below
forward() {
  signalled=1
  if [[ ${#children[@]} -gt 0 ]]; then
    kill -s "$1" "${children[@]}" 2>/dev/null || true
  else
    pending="$1"
  fi
}
trap 'forward TERM' TERM HUP USR1
trap 'forward INT' INT
stamp=$(mktemp)
# torchrun runs in the background, in a session of its own, so that only this script signals it (a
# terminal's hangup or Ctrl-C reaches this script's process group, not torchrun's), and this script
# waits for it: neither torchrun nor its workers outlive the script. If the script itself is killed
# (kill -9 cannot be trapped), the kernel sends torchrun SIGTERM (PR_SET_PDEATHSIG = 1), so the workers
# still save and nothing is orphaned; a script that died before prctl took effect is caught by getppid.
# torchrun ignores SIGUSR1: it has no handler for it and would die of one that reaches it directly
# (SLURM's `scancel --signal=USR1` signals every process of the job step), leaving its workers to
# save as orphans after this script has exited. The workers install their own handler.
# Runs "$@" in a session of its own, ignoring SIGUSR1, with SIGTERM when this script dies. Call it
# in the background (`detached ... &`): the exec makes $! the pid of "$@" itself.
detached() {
  exec "$python" -c 'import ctypes, os, signal, sys
ppid = os.getppid()
os.setsid()
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != ppid:
        sys.exit(143)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}
if [[ $heal -eq 0 ]]; then
  detached "$python" -m torch.distributed.run "${rdzv[@]}" "${nproc_flag[@]}" "${max_restarts_flag[@]}" \
    "$here/ddp_training.py" "${train_args[@]}" &
  children=($!)
else
  # Healing in place: the run's store in a process of its own (framework/ddp/run_store.py), then one
  # torchrun job per rank, each restarting only its own worker (torchrun restarts every worker of
  # a job when one fails, which is why torchft too runs each replica group as a job of its own).
  # On N nodes, node 0 serves it on --rdzv-endpoint's port and the others reach it there; its
  # replicas are node_rank x nproc + 0..nproc-1.
  if [[ $max_nodes -eq 1 || $node_rank -eq 0 ]]; then
    port_file=$(mktemp)
    rm -f "$port_file"
    store_port=0
    [[ $max_nodes -eq 1 ]] || store_port=${rdzv_endpoint##*:}
    (cd "$here" && detached "$python" -m framework.ddp.run_store "$port_file" "$store_port") &
    store_pid=$!
    for _ in $(seq 600); do [[ -s "$port_file" ]] && break; kill -0 "$store_pid" 2>/dev/null || break; sleep 0.05; done
    [[ -s "$port_file" ]] || die "--heal: the run's store did not start (port $store_port taken?)"
    HEAL_STORE="127.0.0.1:$(cat "$port_file")"
    rm -f "$port_file"
  fi
  [[ $max_nodes -eq 1 ]] || HEAL_STORE=$rdzv_endpoint
  # HEAL_LAUNCH names this launch: a worker that an older launch's torchrun starts again (its node
  # frozen, named lost and launched again meanwhile) ends instead of taking its replica back.
  HEAL_LAUNCH="$(hostname)-$$-$(date +%s%N)"
  export HEAL_STORE HEAL_REPLICAS=$(( nproc * max_nodes )) HEAL_SPARES="$spares" HEAL_LAUNCH
  [[ $cpu -eq 1 ]] || IFS=, read -r -a gpu_list <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( nproc - 1 )))}"
  for (( local_rank = 0; local_rank < nproc; local_rank++ )); do
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    gpu_env=()
    [[ $cpu -eq 1 ]] || gpu_env=(CUDA_VISIBLE_DEVICES="${gpu_list[$local_rank]}")
    HEAL_REPLICA=$(( node_rank * nproc + local_rank )) detached env "${gpu_env[@]}" "$python" -m torch.distributed.run --nnodes 1 \
      --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --local-addr 127.0.0.1 --nproc-per-node 1 \
      "${max_restarts_flag[@]}" "$here/ddp_training.py" "${train_args[@]}" &
    children+=($!)
  done
fi
[[ -z "$pending" ]] || kill -s "$pending" "${children[@]}" 2>/dev/null || true
marker="$checkpoint_dir/PREEMPTED"
final="$checkpoint_dir/final_model.pt"
lost="$checkpoint_dir/NODE_LOST"
fatal="$checkpoint_dir/FATAL"
# A fixed-size run (--nnodes N, N > 1) that lost a node cannot go on without it: torchrun's agent
# would wait in the next rendezvous for the whole join timeout. Once a worker wrote NODE_LOST (a
# restart's first process clears it) and torchrun has had no worker for --rdzv-rejoin-timeout
# seconds, the node did not rejoin: stop torchrun, and exit 75 saying so.
watch_rejoin=0 gave_up=0 idle_since=""
[[ $max_nodes -gt 1 && $min_nodes -eq $max_nodes ]] && watch_rejoin=1
# shellcheck disable=SC2329  # called in the loop below
has_workers() { [[ -n "$(cat /proc/"$1"/task/*/children 2>/dev/null)" ]]; }
# Healing in place, a worker of this node (or its torchrun agent) left stopped (SIGSTOP: a process
# frozen on a live host) once the run has finished or stopped (the final model, FATAL or NODE_LOST
# written since this launch) would keep its torchrun job, and so this launcher, waiting for good;
# rank 0 stopped there also holds checkpoint.dir's lock, which a restart needs. Its peers healed
# without it, or gave up: stopped for STOPPED_GRACE_S polls in a row (HEAL_STOPPED_GRACE_S, 10 s),
# it is killed, as a member found stopped is; its torchrun starts it again (it finds the run
# finished and ends 0, or restarts it through the run's store) or ends.
reaped=0 stopped_polls=0
# shellcheck disable=SC2329  # called in the loops below
reap_stopped() {
  local ended job pid workers stopped=()
  for ended in "$final" "$fatal" "$lost"; do
    [[ -f "$ended" && "$ended" -nt "$stamp" ]] && break
    ended=""
  done
  [[ -n "$ended" ]] || return 0
  for job in "${children[@]}"; do
    read -r -a workers <<< "$(cat /proc/"$job"/task/*/children 2>/dev/null | tr '\n' ' ')"
    for pid in "$job" "${workers[@]}"; do  # its torchrun agent, and its worker
      [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" != T* ]] || stopped+=("$pid")
    done
  done
  if [[ ${#stopped[@]} -eq 0 ]]; then
    stopped_polls=0
    return 0
  fi
  stopped_polls=$(( stopped_polls + 1 ))
  (( stopped_polls >= STOPPED_GRACE_S )) || return 0
  kill -s KILL "${stopped[@]}" 2>/dev/null || true
  reaped=1 stopped_polls=0
  echo "launch_training.sh: the run $([[ $ended == "$final" ]] && echo finished || echo stopped)," \
       "and process(es) ${stopped[*]} of this node stayed stopped (SIGSTOP) for ${STOPPED_GRACE_S} s: killed," \
       "so that their torchrun jobs end" >&2 || true
}
# `wait` returns early (128 + the signal) when a trapped signal arrives: wait until torchrun has
# really ended, then ask once more for its own status (bash keeps it for an ended child).
child=${children[0]}
while kill -0 "$child" 2>/dev/null; do
  if [[ $watch_rejoin -eq 0 && $heal -eq 0 ]]; then
    wait "$child" || true
    continue
  fi
  sleep 1 &
  wait $! || true
  [[ $heal -eq 0 ]] || reap_stopped
  if [[ $watch_rejoin -eq 1 && $gave_up -eq 0 && -f "$lost" && "$lost" -nt "$stamp" ]] && ! has_workers "$child"; then
    idle_since=${idle_since:-$SECONDS}
    if (( SECONDS - idle_since >= rejoin_timeout )); then
      gave_up=1
      kill -s TERM "$child" 2>/dev/null || true
    fi
  else
    idle_since=""
  fi
done
wait "$child" && status=0 || status=$?
if [[ $heal -eq 1 ]]; then
  # The run finished when a rank's job ended 0 and the final model was written by this launch (a
  # replica stopped while it waited to join ends 0 too), and no rank stopped with a FATAL since (the
  # export after final_model.pt, on a full disk); else the first failure stands.
  any_ok=$(( status == 0 ))
  for other in "${children[@]:1}"; do
    while kill -0 "$other" 2>/dev/null; do
      sleep 1 &
      wait $! || true
      reap_stopped
    done
    wait "$other" && other_status=0 || other_status=$?
    [[ $other_status -ne 0 ]] || any_ok=1
    [[ $status -ne 0 || $other_status -eq 0 ]] || status=$other_status
  done
  if [[ $any_ok -eq 1 || $reaped -eq 1 ]] && [[ -f "$final" && "$final" -nt "$stamp" ]] &&
     ! [[ -f "$fatal" && "$fatal" -nt "$stamp" ]]; then
    status=0
  fi
  if [[ -n "$store_pid" ]]; then
    kill -s TERM "$store_pid" 2>/dev/null || true
    wait "$store_pid" || true
  fi
fi
if [[ $gave_up -eq 1 ]]; then
  echo "launch_training.sh: a node of this fixed-size run (--nnodes $nnodes) was lost and did not rejoin within" \
       "${rejoin_timeout} s ($(cat "$lost" 2>/dev/null)); relaunch once it is back, and the run resumes from its newest" \
       "checkpoint, or use --nnodes 1:$max_nodes to go on without it" >&2 || true
  status=75
elif [[ $status -ne 0 && -f "$fatal" && "$fatal" -nt "$stamp" ]]; then
  # First: a FATAL stop is one that no restart or requeue can fix, whatever a peer saw on its way
  # out (NODE_LOST, when one rank's deterministic error ended the others' collectives).
  echo "launch_training.sh: stopped, and a relaunch would fail the same way: $(cat "$fatal")" >&2 || true
elif [[ $status -ne 0 && -f "$lost" && "$lost" -nt "$stamp" ]]; then
  # torchrun exits 1 whatever its workers said; they exit 75 when a node of the run is lost.
  echo "launch_training.sh: a node of the run was lost ($(cat "$lost")); relaunch to resume" >&2 || true
  status=75
elif [[ $status -ne 0 && -f "$marker" && "$marker" -nt "$stamp" ]]; then
  # After an ssh drop stderr is gone: a failed message must not change the exit code.
  echo "launch_training.sh: preempted; $(cat "$marker"); resume with the same command" >&2 || true
  status=0
elif [[ $status -ne 0 && $signalled -eq 1 && -f "$final" && "$final" -nt "$stamp" ]]; then
  # The signal came during the final evaluation or save, which the workers finished; torchrun
  # still exits 1 after forwarding a signal.
  echo "launch_training.sh: signalled after the last step; the run finished" >&2 || true
  status=0
fi
rm -f "$stamp"
exit "$status"
