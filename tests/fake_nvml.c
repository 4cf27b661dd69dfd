/* A stand-in for NVIDIA's libnvidia-ml.so.1, built as tests/fake_nvml/libnvidia-ml.so.1 (and, with
 * FAKE_NVML_MINIMAL, as tests/fake_nvml_minimal/libnvidia-ml.so.1 with only the three functions the trainer
 * requires, as an old driver's library would lack the rest). Its answers come from the environment, so
 * that tests/test_nvml.cpp can run the trainer's NVML code in a child process against known values:
 *
 *   FAKE_NVML_INIT_FAIL=1        nvmlInit_v2 fails (NVML_ERROR_DRIVER_NOT_LOADED, 9)
 *   FAKE_NVML_UUIDS=GPU-a,GPU-b  the GPUs, in NVML's index order (default: one, GPU-00000000-fake)
 *   FAKE_NVML_MIG_UUIDS=MIG-x,.. GPU 0 is in MIG mode with these slices visible (default: not in MIG mode)
 *   FAKE_NVML_GPU_I_IDS=3,5      the slices' GPU instance ids (default 1, 2, ...)
 *   FAKE_NVML_UTIL=37            utilisation of every GPU, percent (default 0)
 *   FAKE_NVML_MEM_USED=N, FAKE_NVML_MEM_TOTAL=N  bytes (default 1 GiB of 80 GiB)
 *
 * Handles are pointers into two static tables; NVML's return codes: 0 success, 2 invalid argument,
 * 3 not supported, 6 not found. */
#include <stdlib.h>
#include <string.h>

#define MAX_DEVICES 8

typedef struct {
  int is_mig;
  int index;  /* in its table */
  char uuid[96];
} FakeDevice;

static FakeDevice gpus[MAX_DEVICES], migs[MAX_DEVICES];
static int n_gpus, n_migs;

static int split(const char* list, FakeDevice* out, int is_mig) {
  int n = 0;
  const char* p = list;
  while (p && *p && n < MAX_DEVICES) {
    const char* end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len >= sizeof out[n].uuid) len = sizeof out[n].uuid - 1;
    memcpy(out[n].uuid, p, len);
    out[n].uuid[len] = '\0';
    out[n].is_mig = is_mig;
    out[n].index = n;
    ++n;
    p = end ? end + 1 : NULL;
  }
  return n;
}

/* The i-th number of a comma-separated list, or `fallback`. */
static long long nth_number(const char* list, int i, long long fallback) {
  const char* p = list;
  for (int k = 0; p && *p; ++k) {
    if (k == i) return atoll(p);
    p = strchr(p, ',');
    if (p) ++p;
  }
  return fallback;
}

static long long env_number(const char* name, long long fallback) {
  const char* v = getenv(name);
  return v && *v ? atoll(v) : fallback;
}

int nvmlInit_v2(void) {
  if (env_number("FAKE_NVML_INIT_FAIL", 0)) return 9;
  const char* uuids = getenv("FAKE_NVML_UUIDS");
  n_gpus = split(uuids && *uuids ? uuids : "GPU-00000000-fake", gpus, 0);
  n_migs = split(getenv("FAKE_NVML_MIG_UUIDS"), migs, 1);
  return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (index >= (unsigned)n_gpus || !device) return 2;
  *device = &gpus[index];
  return 0;
}

typedef struct {
  unsigned int gpu, memory;
} FakeUtilization;

int nvmlDeviceGetUtilizationRates(void* device, FakeUtilization* u) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || !u) return 2;
  if (d->is_mig || (d->index == 0 && n_migs > 0)) return 3; /* NVML has none for a slice or a GPU in MIG mode */
  u->gpu = (unsigned)env_number("FAKE_NVML_UTIL", 0);
  u->memory = 0;
  return 0;
}

#ifndef FAKE_NVML_MINIMAL

typedef struct {
  unsigned long long total, free, used;
} FakeMemory;

int nvmlDeviceGetMemoryInfo(void* device, FakeMemory* m) {
  if (!device || !m) return 2;
  m->total = (unsigned long long)env_number("FAKE_NVML_MEM_TOTAL", 80LL << 30);
  m->used = (unsigned long long)env_number("FAKE_NVML_MEM_USED", 1LL << 30);
  m->free = m->total - m->used;
  return 0;
}

int nvmlDeviceGetUUID(void* device, char* uuid, unsigned int length) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || !uuid || length < strlen(d->uuid) + 1) return 2;
  strcpy(uuid, d->uuid);
  return 0;
}

int nvmlDeviceGetHandleByUUID(const char* uuid, void** device) {
  for (int i = 0; i < n_gpus; ++i)
    if (strcmp(gpus[i].uuid, uuid) == 0) return *device = &gpus[i], 0;
  for (int i = 0; i < n_migs; ++i)
    if (strcmp(migs[i].uuid, uuid) == 0) return *device = &migs[i], 0;
  return 6;
}

int nvmlDeviceGetIndex(void* device, unsigned int* index) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || d->is_mig) return 2;
  *index = (unsigned)d->index;
  return 0;
}

int nvmlDeviceGetMigMode(void* device, unsigned int* current, unsigned int* pending) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || d->is_mig) return 2;
  *current = *pending = (d->index == 0 && n_migs > 0) ? 1 : 0;
  return 0;
}

int nvmlDeviceGetMaxMigDeviceCount(void* device, unsigned int* count) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || d->is_mig) return 2;
  *count = d->index == 0 && n_migs > 0 ? 7 : 0; /* an A100's 7 slots, some empty */
  return 0;
}

int nvmlDeviceGetMigDeviceHandleByIndex(void* device, unsigned int index, void** mig) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || d->is_mig || d->index != 0) return 2;
  if (index >= (unsigned)n_migs) return 6; /* an empty slot */
  *mig = &migs[index];
  return 0;
}

int nvmlDeviceGetDeviceHandleFromMigDeviceHandle(void* mig, void** device) {
  FakeDevice* d = (FakeDevice*)mig;
  if (!d || !d->is_mig || n_gpus == 0) return 2;
  *device = &gpus[0];
  return 0;
}

int nvmlDeviceGetGpuInstanceId(void* device, unsigned int* id) {
  FakeDevice* d = (FakeDevice*)device;
  if (!d || !d->is_mig) return 2;
  *id = (unsigned)nth_number(getenv("FAKE_NVML_GPU_I_IDS"), d->index, d->index + 1);
  return 0;
}

#endif /* FAKE_NVML_MINIMAL */
