/*
 * A fake libnvidia-ml.so.1 for CPU-only machines (accelsched.testing).
 *
 * Loaded by the real pynvml bindings, it reports the GPUs described in the state
 * directory named by ACCELSCHED_FAKE_NVML_DIR, re-read on every call so that every
 * process (client, scheduler, nannies, workers) sees the same devices and the same
 * per-process memory, written by accelsched.testing's simulated pool:
 *
 *   devices      one line per device, NVML index = line order:
 *                <uuid>\t<name>\t<total>[\tmig]  ("mig": the GPU is in MIG mode)
 *   mig          optional, one line per MIG device (GPU instance + compute instance):
 *                <parent nvml index>\t<MIG-uuid>\t<name>\t<total>\t<gi id>\t<ci id>
 *   flags        optional lines: no_process_memory | pid_offset <n> | context_bytes <n> |
 *                fault <nvml_index> all|memory|processes|lost  (injected NVML errors)
 *   proc/<pid>   lines "<slot> <bytes>": that process's device memory, where a slot is
 *                an NVML index for a whole GPU, and count + k for the k-th line of `mig`;
 *                first, where known, "start <ticks>": the writer's start time (field 22
 *                of Linux's /proc/<pid>/stat)
 *
 * The file of a process that has ended is ignored, as the driver frees an ended
 * process's memory: a dead pid, a zombie, or a pid now used by a later process (its
 * start time differs from the file's). Like
 * the real library, devices are numbered physically: CUDA_VISIBLE_DEVICES is ignored,
 * and MIG devices are not counted by nvmlDeviceGetCount: they are reached through
 * their parent (nvmlDeviceGetMigDeviceHandleByIndex) or by UUID. A MIG-mode GPU's
 * memory is the sum of its instances'; a fault on a GPU reaches its MIG devices.
 * Struct layouts follow nvml.h (sizes are checked below against pynvml's).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_DEVICES 64
#define MAX_MIGS 128         /* MIG devices over all GPUs */
#define MAX_MIG_PER_GPU 7    /* what nvmlDeviceGetMaxMigDeviceCount says (A100, H100, H200) */
#define MAX_PROCS 1024
#define PATH_SIZE (4096 + 300) /* the state dir (< 4096) + "/proc/" + a file name */
#define NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NOT_AVAILABLE_UINT 0xFFFFFFFFU
#define NVML_MEMORY_V2 0x02000028U

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");

/* Handles are addresses inside these arrays: the index is the offset, nothing to free.
 * A MIG device's handle is its line in `mig`. */
static char g_handles[MAX_DEVICES];
static char g_mig_handles[MAX_MIGS];
static int g_refcount;

/* Lets accelsched tell this library from a real NVML already loaded in a process. */
int accelsched_fake_nvml = 1;

struct device {
    char uuid[96];
    char name[96];
    unsigned long long total;
    int mig_mode;
    int cc_major, cc_minor; /* CUDA compute capability */
};
struct mig {
    char uuid[96];
    char name[96];
    unsigned long long total;
    unsigned parent, position; /* position: its index under the parent */
    unsigned gi, ci;
};
struct proc { unsigned int pid; unsigned long long bytes; unsigned gi, ci; };
struct state {
    char dir[4096];
    unsigned count;
    struct device dev[MAX_DEVICES];
    unsigned nmig;
    struct mig mig[MAX_MIGS];
    int no_process_memory;
    long long pid_offset;
    unsigned char fault[MAX_DEVICES]; /* FAULT_* bits per NVML index */
};

/* Injected faults: which device queries fail, and how. */
#define FAULT_ALL 1u       /* every query: NVML_ERROR_UNKNOWN */
#define FAULT_MEMORY 2u    /* memory info only */
#define FAULT_PROCESSES 4u /* process lists only */
#define FAULT_LOST 8u      /* every query: NVML_ERROR_GPU_IS_LOST */

/* Reads the MIG devices of GPUs in MIG mode, at most MAX_MIG_PER_GPU each. */
static void load_migs(struct state *st)
{
    char path[PATH_SIZE], line[512];
    unsigned per_gpu[MAX_DEVICES] = {0};
    FILE *f;

    snprintf(path, sizeof(path), "%s/mig", st->dir);
    if ((f = fopen(path, "r")) == NULL)
        return;
    while (st->nmig < MAX_MIGS && fgets(line, sizeof(line), f)) {
        struct mig *m = &st->mig[st->nmig];
        char *parent = strtok(line, "\t\n"), *uuid = strtok(NULL, "\t\n");
        char *name = strtok(NULL, "\t\n"), *total = strtok(NULL, "\t\n");
        char *gi = strtok(NULL, "\t\n"), *ci = strtok(NULL, "\t\n");
        unsigned long p;
        if (parent == NULL || uuid == NULL || name == NULL || total == NULL || gi == NULL ||
            ci == NULL)
            continue;
        p = strtoul(parent, NULL, 10);
        if (p >= st->count || !st->dev[p].mig_mode || per_gpu[p] >= MAX_MIG_PER_GPU)
            continue;
        snprintf(m->uuid, sizeof(m->uuid), "%s", uuid);
        snprintf(m->name, sizeof(m->name), "%s", name);
        m->total = strtoull(total, NULL, 10);
        m->parent = (unsigned)p;
        m->position = per_gpu[p]++;
        m->gi = (unsigned)strtoul(gi, NULL, 10);
        m->ci = (unsigned)strtoul(ci, NULL, 10);
        st->nmig++;
    }
    fclose(f);
}

/* Reads devices and flags; 0 on success. */
static int load_state(struct state *st)
{
    const char *dir = getenv("ACCELSCHED_FAKE_NVML_DIR");
    char path[PATH_SIZE], line[512];
    FILE *f;

    memset(st, 0, sizeof(*st));
    if (dir == NULL || *dir == '\0' || strlen(dir) >= sizeof(st->dir))
        return -1;
    strcpy(st->dir, dir);
    snprintf(path, sizeof(path), "%s/devices", dir);
    if ((f = fopen(path, "r")) == NULL)
        return -1;
    while (st->count < MAX_DEVICES && fgets(line, sizeof(line), f)) {
        struct device *d = &st->dev[st->count];
        char *uuid = strtok(line, "\t\n"), *name = strtok(NULL, "\t\n");
        char *total = strtok(NULL, "\t\n"), *mode = strtok(NULL, "\t\n");
        char *cc = strtok(NULL, "\t\n");
        if (uuid == NULL || name == NULL || total == NULL)
            continue;
        snprintf(d->uuid, sizeof(d->uuid), "%s", uuid);
        snprintf(d->name, sizeof(d->name), "%s", name);
        d->total = strtoull(total, NULL, 10);
        d->mig_mode = mode != NULL && strcmp(mode, "mig") == 0;
        d->cc_major = 9;
        d->cc_minor = 0;
        if (cc != NULL && sscanf(cc, "%d.%d", &d->cc_major, &d->cc_minor) != 2) {
            d->cc_major = 9;
            d->cc_minor = 0;
        }
        st->count++;
    }
    fclose(f);
    load_migs(st);
    snprintf(path, sizeof(path), "%s/flags", dir);
    if ((f = fopen(path, "r")) != NULL) {
        while (fgets(line, sizeof(line), f)) {
            if (strncmp(line, "no_process_memory", 17) == 0)
                st->no_process_memory = 1;
            else if (strncmp(line, "pid_offset", 10) == 0)
                st->pid_offset = strtoll(line + 10, NULL, 10);
            else if (strncmp(line, "fault ", 6) == 0) {
                char *end;
                unsigned long i = strtoul(line + 6, &end, 10);
                while (*end == ' ')
                    end++;
                if (i >= MAX_DEVICES)
                    continue;
                if (strncmp(end, "all", 3) == 0)
                    st->fault[i] |= FAULT_ALL;
                else if (strncmp(end, "memory", 6) == 0)
                    st->fault[i] |= FAULT_MEMORY;
                else if (strncmp(end, "processes", 9) == 0)
                    st->fault[i] |= FAULT_PROCESSES;
                else if (strncmp(end, "lost", 4) == 0)
                    st->fault[i] |= FAULT_LOST;
            }
        }
        fclose(f);
    }
    return 0;
}

/* From /proc/<pid>/stat: the state letter and the start time; 0 where unreadable. Where
 * /proc exists but holds no such process (it ended after kill saw it): state 'X'. */
static int proc_stat(pid_t pid, char *state, unsigned long long *start)
{
    char path[64], buf[1024], *p;
    size_t n;
    FILE *f;
    snprintf(path, sizeof(path), "/proc/%ld/stat", (long)pid);
    if ((f = fopen(path, "r")) == NULL) {
        if (errno == ENOENT && access("/proc/self/stat", R_OK) == 0) {
            *state = 'X';
            *start = 0;
            return 1;
        }
        return 0;
    }
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    if ((p = strrchr(buf, ')')) == NULL) /* after the command, which may hold ')' */
        return 0;
    /* state (field 3), then fields 4..21, then starttime (field 22) */
    if (sscanf(p + 1, " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s "
                      "%*s %*s %llu", state, start) != 2)
        return 0;
    return 1;
}

/* Whether `pid`, which kill(pid, 0) found, is no zombie and, when `start` is known
 * (`has_start`), is the process that started then rather than a later one on a reused
 * pid. */
static int alive(pid_t pid, int has_start, unsigned long long start)
{
    char state;
    unsigned long long now;
    if (!proc_stat(pid, &state, &now)) /* no /proc: what kill says */
        return 1;
    return state != 'Z' && state != 'X' && (!has_start || now == start);
}

static int by_pid(const void *a, const void *b)
{
    const struct proc *x = a, *y = b;
    if (x->pid != y->pid)
        return (x->pid > y->pid) - (x->pid < y->pid);
    return (x->gi > y->gi) - (x->gi < y->gi);
}

/* What a handle names: a whole GPU, or a MIG device (`mig` >= 0, its line in `mig`). */
struct target { unsigned gpu; int mig; };

/* Whether memory in `slot` (see the header) is on `t`: a MIG device holds its own slot, a
 * whole GPU its own and every one of its MIG devices'. */
static int on_target(const struct state *st, const struct target *t, unsigned slot)
{
    if (t->mig >= 0)
        return slot == st->count + (unsigned)t->mig;
    if (slot == t->gpu)
        return 1;
    return slot >= st->count && slot - st->count < st->nmig &&
           st->mig[slot - st->count].parent == t->gpu;
}

/* Live processes' memory on `t`, sorted by pid, one entry per process and MIG device
 * (GPU and compute instance ids NOT_AVAILABLE outside MIG); returns their count. */
static unsigned load_procs(const struct state *st, const struct target *t, struct proc *out)
{
    char path[PATH_SIZE], line[128];
    unsigned n = 0;
    struct dirent *e;
    DIR *d;

    snprintf(path, sizeof(path), "%s/proc", st->dir);
    if ((d = opendir(path)) == NULL)
        return 0;
    while (n < MAX_PROCS && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        unsigned long long start = 0;
        int has_start;
        FILE *f;
        if (*e->d_name == '\0' || *end != '\0' || pid <= 0)
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
            continue; /* most records left behind are of dead pids: not opened */
        snprintf(path, sizeof(path), "%s/proc/%s", st->dir, e->d_name);
        if ((f = fopen(path, "r")) == NULL)
            continue; /* replaced or removed meanwhile */
        if (fgets(line, sizeof(line), f) == NULL) {
            fclose(f);
            continue;
        }
        has_start = sscanf(line, "start %llu", &start) == 1;
        if (!alive((pid_t)pid, has_start, start)) {
            fclose(f);
            continue;
        }
        if (has_start && fgets(line, sizeof(line), f) == NULL) {
            fclose(f);
            continue;
        }
        do {
            unsigned slot;
            unsigned long long bytes;
            if (sscanf(line, "%u %llu", &slot, &bytes) == 2 && on_target(st, t, slot)) {
                int mig = slot >= st->count ? (int)(slot - st->count) : -1;
                out[n].pid = (unsigned)pid;
                out[n].bytes = bytes;
                out[n].gi = mig >= 0 ? st->mig[mig].gi : NOT_AVAILABLE_UINT;
                out[n].ci = mig >= 0 ? st->mig[mig].ci : NOT_AVAILABLE_UINT;
                n++;
            }
        } while (n < MAX_PROCS && fgets(line, sizeof(line), f));
        fclose(f);
    }
    closedir(d);
    qsort(out, n, sizeof(*out), by_pid);
    return n;
}

static int initialized(void) { return __atomic_load_n(&g_refcount, __ATOMIC_SEQ_CST) > 0; }

/* Common prologue of every device query: initialized, state readable, valid handle, and
 * no fault injected for this kind of query (`kind`: FAULT_MEMORY, FAULT_PROCESSES or 0)
 * on the GPU (a MIG device's parent). */
static nvmlReturn_t device_state(nvmlDevice_t h, struct state *st, struct target *t,
                                 unsigned kind)
{
    uintptr_t p = (uintptr_t)h, gpus = (uintptr_t)g_handles, migs = (uintptr_t)g_mig_handles;
    if (!initialized() || load_state(st) != 0)
        return NVML_ERROR_UNINITIALIZED;
    if (h != NULL && p >= gpus && p - gpus < st->count) {
        t->gpu = (unsigned)(p - gpus);
        t->mig = -1;
    } else if (h != NULL && p >= migs && p - migs < st->nmig) {
        t->mig = (int)(p - migs);
        t->gpu = st->mig[t->mig].parent;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (st->fault[t->gpu] & FAULT_LOST)
        return NVML_ERROR_GPU_IS_LOST;
    if (st->fault[t->gpu] & (FAULT_ALL | kind))
        return NVML_ERROR_UNKNOWN;
    return NVML_SUCCESS;
}

static unsigned long long device_used(const struct state *st, const struct target *t)
{
    struct proc procs[MAX_PROCS];
    unsigned long long used = 0;
    unsigned n = load_procs(st, t, procs);
    for (unsigned i = 0; i < n; i++)
        used += procs[i].bytes;
    return used;
}

static nvmlReturn_t copy_string(const char *src, char *dst, unsigned int length)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* ---- init / shutdown / errors ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    struct state st;
    (void)flags;
    if (load_state(&st) != 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    __atomic_add_fetch(&g_refcount, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    int now = __atomic_load_n(&g_refcount, __ATOMIC_SEQ_CST);
    while (now > 0) {
        if (__atomic_compare_exchange_n(&g_refcount, &now, now - 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            return NVML_SUCCESS;
    }
    return NVML_ERROR_UNINITIALIZED;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, "
                    "becasue ECC is enabled";
    case 23: return "Ran out of critical resources, other than memory";
    case 24: return "The requested frequency is not supported";
    case 25: return "The provided version is invalid/unsupported";
    case 26: return "The requested functionality has been deprecated";
    case 27: return "The system is not ready for the request";
    case 28: return "The GPU was not found";
    case 29: return "The operation is invalid in the current state";
    case 30: return "The reset type is not supported";
    default: return "Unknown Error";
    }
}

/* ---- system ---- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_string("555.42.06", version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return copy_string("12.555.42.06", version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = 12050;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return nvmlSystemGetCudaDriverVersion(version);
}

/* ---- device enumeration ---- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    struct state st;
    if (!initialized() || load_state(&st) != 0)
        return NVML_ERROR_UNINITIALIZED;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = st.count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    struct state st;
    if (!initialized() || load_state(&st) != 0)
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= st.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&g_handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    struct state st;
    if (!initialized() || load_state(&st) != 0)
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < st.count; i++) {
        if (strcmp(st.dev[i].uuid, uuid) == 0) {
            *device = (nvmlDevice_t)&g_handles[i];
            return NVML_SUCCESS;
        }
    }
    for (unsigned i = 0; i < st.nmig; i++) {
        if (strcmp(st.mig[i].uuid, uuid) == 0) {
            *device = (nvmlDevice_t)&g_mig_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* ---- per-device queries ---- */

/* Declares st and t for `device`, or returns the error. Buffers live on the stack
 * (about 60 KiB with a process list): no shared state, so calls from threads can overlap. */
#define DEVICE_PROLOGUE_OF(kind)                            \
    struct state st;                                        \
    struct target t;                                        \
    nvmlReturn_t ret = device_state(device, &st, &t, kind); \
    if (ret != NVML_SUCCESS)                                \
        return ret;
#define DEVICE_PROLOGUE DEVICE_PROLOGUE_OF(0)

/* A MIG device answers with its parent's index (as distributed's diagnostics expect). */
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *out)
{
    DEVICE_PROLOGUE
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = t.gpu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return nvmlDeviceGetIndex(device, minor);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEVICE_PROLOGUE
    return copy_string(t.mig >= 0 ? st.mig[t.mig].name : st.dev[t.gpu].name, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEVICE_PROLOGUE
    return copy_string(t.mig >= 0 ? st.mig[t.mig].uuid : st.dev[t.gpu].uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEVICE_PROLOGUE_OF(FAULT_MEMORY)
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = t.mig >= 0 ? st.mig[t.mig].total : st.dev[t.gpu].total;
    memory->used = device_used(&st, &t);
    memory->free = memory->used < memory->total ? memory->total - memory->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlMemory_t v1;
    nvmlReturn_t ret;
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if ((ret = nvmlDeviceGetMemoryInfo(device, &v1)) != NVML_SUCCESS)
        return ret;
    memory->total = v1.total;
    memory->reserved = 0;
    memory->free = v1.free;
    memory->used = v1.used;
    return NVML_SUCCESS;
}

/* The count-query protocol shared by every process list: too small -> count, INSUFFICIENT_SIZE. */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *count, void *infos,
                                      int version)
{
    struct proc procs[MAX_PROCS];
    DEVICE_PROLOGUE_OF(FAULT_PROCESSES)
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = load_procs(&st, &t, procs);
    if (*count < n || (n > 0 && infos == NULL)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        unsigned pid = (unsigned)((long long)procs[i].pid + st.pid_offset);
        unsigned long long bytes = st.no_process_memory ? NOT_AVAILABLE_ULL : procs[i].bytes;
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = pid;
            p->usedGpuMemory = bytes;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + i;
            p->pid = pid;
            p->usedGpuMemory = bytes;
            p->gpuInstanceId = procs[i].gi;
            p->computeInstanceId = procs[i].ci;
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, void *i)
{
    return running_processes(d, c, i, 1);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, void *i)
{
    return running_processes(d, c, i, 2);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, void *i)
{
    return running_processes(d, c, i, 3);
}

/* Simulated GPUs run no graphics: always an empty list. */
static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *count)
{
    DEVICE_PROLOGUE
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned int *c, void *i)
{
    (void)i;
    return no_processes(d, c);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, void *i)
{
    (void)i;
    return no_processes(d, c);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, void *i)
{
    (void)i;
    return no_processes(d, c);
}

/* Simulated GPUs compute nothing: utilization is always 0 %. Like the real library,
 * neither a MIG device nor a GPU in MIG mode reports it. */
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    DEVICE_PROLOGUE
    if (t.mig >= 0 || st.dev[t.gpu].mig_mode)
        return NVML_ERROR_NOT_SUPPORTED;
    if (util == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = 0;
    util->memory = 0;
    return NVML_SUCCESS;
}

/* ---- MIG ---- */

/* A GPU simulated without MIG is not MIG-capable: NOT_SUPPORTED, as on a consumer GPU.
 * A MIG device has no mode of its own (NOT_SUPPORTED too). A GPU given partitions is in
 * MIG mode, current and pending. */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    DEVICE_PROLOGUE
    if (t.mig >= 0 || !st.dev[t.gpu].mig_mode)
        return NVML_ERROR_NOT_SUPPORTED;
    if (current == NULL || pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *current = 1; /* NVML_DEVICE_MIG_ENABLE */
    *pending = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    DEVICE_PROLOGUE
    if (t.mig >= 0 || !st.dev[t.gpu].mig_mode)
        return NVML_ERROR_NOT_SUPPORTED;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = MAX_MIG_PER_GPU;
    return NVML_SUCCESS;
}

/* Indices run 0 .. max-1; one with no MIG device behind it is NOT_FOUND. */
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *migDevice)
{
    DEVICE_PROLOGUE
    if (t.mig >= 0 || !st.dev[t.gpu].mig_mode)
        return NVML_ERROR_NOT_SUPPORTED;
    if (migDevice == NULL || index >= MAX_MIG_PER_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < st.nmig; i++) {
        if (st.mig[i].parent == t.gpu && st.mig[i].position == index) {
            *migDevice = (nvmlDevice_t)&g_mig_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t device,
                                                          nvmlDevice_t *parent)
{
    DEVICE_PROLOGUE
    if (t.mig < 0 || parent == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *parent = (nvmlDevice_t)&g_handles[t.gpu];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    DEVICE_PROLOGUE
    if (isMigDevice == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = t.mig >= 0;
    return NVML_SUCCESS;
}

/* Only MIG devices have instance ids; a whole GPU answers NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    DEVICE_PROLOGUE
    if (t.mig < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (id == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = st.mig[t.mig].gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    DEVICE_PROLOGUE
    if (t.mig < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (id == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = st.mig[t.mig].ci;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    DEVICE_PROLOGUE
    if (major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = st.dev[t.gpu].cc_major; /* a MIG device: its parent GPU's */
    *minor = st.dev[t.gpu].cc_minor;
    return NVML_SUCCESS;
}

/* Every CPU this process may run on is "near" every fake GPU (dask-cuda asks this). */
nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int size,
                                      unsigned long long *cpus)
{
    cpu_set_t set;
    DEVICE_PROLOGUE
    if (cpus == NULL || size == 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(cpus, 0, size * sizeof(*cpus));
    if (sched_getaffinity(0, sizeof(set), &set) != 0)
        return NVML_ERROR_UNKNOWN;
    for (unsigned cpu = 0; cpu < size * 64 && cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &set))
            cpus[cpu / 64] |= 1ULL << (cpu % 64);
    return NVML_SUCCESS;
}
