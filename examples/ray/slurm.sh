#!/bin/bash
# accelgen run --ray on a Slurm allocation: the Ray head on the allocation's first node, a Ray worker on each of the
# others (started with srun), then one accelgen command on the first node that drives a replica per GPU.
# Submit with `sbatch examples/ray/slurm.sh`; see docs/parallelism.md#many-machines-for-throughput-ray.
#
# Every node needs the same environment (pip install "accelgen[ray]") and the model at the same path (a shared
# file system, or a copy on each node). The dataset and the output are only read and written on the first node.

#SBATCH --job-name=accelgen-ray
#SBATCH --nodes=4
#SBATCH --exclusive
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00

set -euo pipefail

MODEL=${MODEL:-/shared/models/m}          # the same path on every node, or a Hub id
DATASET=${DATASET:-rows.jsonl}            # read by the driver on the first node only
OUTPUT=${OUTPUT:-out.jsonl}               # written there; the same command resumes it
PORT=6379

# SLURM_GPUS_PER_NODE is "4", or "a100:4" where a GPU type was asked for
GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}
CPUS_PER_NODE=${SLURM_CPUS_PER_TASK}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_NODE=${NODES[0]}
# hostname --ip-address may give several addresses (IPv6 among them): keep the first IPv4 one
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | tr ' ' '\n' | grep -m1 '\.')
HEAD_ADDRESS=$HEAD_IP:$PORT
echo "Ray head: $HEAD_NODE ($HEAD_ADDRESS), ${#NODES[@]} nodes of $GPUS_PER_NODE GPUs"

srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" \
    ray start --head --node-ip-address="$HEAD_IP" --port=$PORT \
    --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --block &
sleep 10  # the head must be up before the workers join it

for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \
        ray start --address="$HEAD_ADDRESS" \
        --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" --block &
done
# no wait for the workers: replicas not yet placed wait for their nodes, and the job says so every 30 s

# the driver runs here, on the head node (the replicas check --device cuda where they run), one replica per GPU
accelgen run --ray "$HEAD_ADDRESS" --device cuda \
    --replicas $(( ${#NODES[@]} * GPUS_PER_NODE )) --replica-resources '{"num_gpus": 1}' \
    --model "$MODEL" --dataset "$DATASET" --output "$OUTPUT"
