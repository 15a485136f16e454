# The jobs' run config, beside this script (sbatch runs a copy of the script, from the submit folder).
here=${SLURM_SUBMIT_DIR:-$PWD}
config="$here/run.toml"
# The images' code folder: in {{runtime}} the job's environment overrides the image's.
export PYTHONPATH=/app
{{model_env}}
in_image() {  # in_image [SRUN_OPTION...] -- IMAGE COMMAND...: becomes a job step running COMMAND in IMAGE ({{runtime}})
    local options=()
    while [ "$1" != -- ]; do
        options+=("$1")
        shift
    done
    local image=$2
    shift 2
    {{srun}}
}
