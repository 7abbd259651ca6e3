/*
 * libnvidia-ml.so.1 for the fleet's GPU-less kubelet nodes: the NVML entry points that NVIDIA's
 * k8s-device-plugin and GPU feature discovery v0.19.3 call (through go-nvml, go-nvlib and
 * go-gpuallocator), answering from a node-local state file that the fleet's driver stand-in rewrites
 * when a driver "loads" and "unloads". Types, constants and struct layouts come from NVIDIA's nvml.h
 * as shipped in github.com/NVIDIA/go-nvml v0.13.4-1 (pinned by check/go.mod; ci/build-nvml-shim.sh
 * compiles against it).
 *
 * What it is not: no GPU, kernel module or device node is behind it, and it does not stand in for
 * nvidia-smi. It exports only the functions defined in this file. go-nvml links every NVML symbol
 * unresolved and lets the dynamic linker bind each one at its first call, so a missing symbol does
 * not fail nvmlInit: the process dies ("symbol lookup error") the first time it calls that function.
 * go-nvlib checks four symbols with dlsym before calling them; GetAddressingMode, GetGpuFabricInfo
 * and GetGpuFabricInfoV are left out on purpose, so it reads "not coherent" and "not fabric-attached".
 * MIG is NOT_SUPPORTED, so go-nvlib never reaches the GPU-instance calls this library lacks; as a
 * consequence GFD labels nvidia.com/mig.capable=false, which a real H200 would not. No event is ever
 * delivered: nvmlEventSetWait_v2 sleeps for its timeout and returns NVML_ERROR_TIMEOUT. NVLink is
 * NOT_SUPPORTED and every pair of GPUs has NVML_TOPOLOGY_SYSTEM as common ancestor (go-gpuallocator,
 * which the device plugin's GetPreferredAllocation runs, fails on anything but SUCCESS there).
 *
 * State: the file named by GPUCANARY_NVML_STATE (default /run/nvidia/gpucanary-nvml.env), one
 * KEY=VALUE per line, no spaces around '=', '#' starts a comment line. A missing or empty file, or an
 * empty DRIVER_VERSION, means no driver is loaded. Otherwise every key is required:
 *   DRIVER_VERSION=580.95.05            nvmlSystemGetDriverVersion
 *   CUDA_DRIVER_VERSION=13000           nvmlSystemGetCudaDriverVersion(_v2): 1000*major + 10*minor
 *   PRODUCT_NAME=NVIDIA H200            nvmlDeviceGetName, every GPU
 *   MEMORY_TOTAL_BYTES=150754820096     nvmlDeviceGetMemoryInfo(_v2): all of it free, none used
 *   CUDA_COMPUTE_CAPABILITY=9.0         major.minor
 *   ARCHITECTURE=HOPPER                 the NVML_DEVICE_ARCH_<NAME> suffix
 *   BRAND=NVIDIA                        the NVML_BRAND_<NAME> suffix
 *   PCI_DEVICE_ID=0x233510DE            nvmlPciInfo_t.pciDeviceId (device id << 16 | vendor id)
 *   PCI_SUBSYSTEM_ID=0x18BE10DE         nvmlPciInfo_t.pciSubSystemId
 *   DEVICE=GPU-<uuid> 00000000:18:00.0 0   one line per GPU, in index order: UUID as nvidia-smi -L
 *                                          prints it, PCI bus id, minor number (/dev/nvidia<minor>)
 * A malformed file makes nvmlInit return NVML_ERROR_UNKNOWN and print one line naming the file and
 * line on stderr.
 *
 * The file is read only by the nvmlInit that takes the reference count from 0 to 1. While any caller
 * holds NVML its handles stay valid and its answers do not change, as a real driver cannot be
 * unloaded under an open NVML client (which holds /dev/nvidiactl) either; a reload shows once every
 * caller has shut down and one initializes again. Before that, every call but nvmlErrorString,
 * nvmlInit* and nvmlShutdown returns NVML_ERROR_UNINITIALIZED, nvmlSystemGetNVMLVersion included
 * (nvml.h lists no such error for it, but its answer, NVML_API_VERSION_STR "." DRIVER_VERSION, needs
 * the state).
 */
#define _POSIX_C_SOURCE 200809L
#define NVML_NO_UNVERSIONED_FUNC_DEFS 1 /* so nvmlInit (v1) can be defined beside nvmlInit_v2 */

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml.h"

#define DEFAULT_STATE_PATH "/run/nvidia/gpucanary-nvml.env"
#define MAX_GPUS 64
/* The events k8s-device-plugin's health check registers. */
#define SUPPORTED_EVENTS \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError)

/* go-nvml's nvml.h wraps each handle pointer in a one-member struct; the ABI is NVIDIA's plain pointer. */
struct nvmlDevice_st {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    unsigned int domain, bus, device, minor;
};

/* No event is ever delivered, so an event set has no state: every set is this one object. */
static struct nvmlEventSet_st {
    char unused;
} event_set;

enum key {
    DRIVER_VERSION, CUDA_DRIVER_VERSION, PRODUCT_NAME, MEMORY_TOTAL_BYTES, CUDA_COMPUTE_CAPABILITY,
    ARCHITECTURE, BRAND, PCI_DEVICE_ID, PCI_SUBSYSTEM_ID, DEVICE, KEY_COUNT
};
static const char *const KEY_NAMES[KEY_COUNT] = {
    "DRIVER_VERSION", "CUDA_DRIVER_VERSION", "PRODUCT_NAME", "MEMORY_TOTAL_BYTES", "CUDA_COMPUTE_CAPABILITY",
    "ARCHITECTURE", "BRAND", "PCI_DEVICE_ID", "PCI_SUBSYSTEM_ID", "DEVICE",
};

struct name {
    const char *name;
    unsigned int value;
};
#define ARCH(a) { #a, NVML_DEVICE_ARCH_##a }
static const struct name ARCHITECTURES[] = {
    ARCH(KEPLER), ARCH(MAXWELL), ARCH(PASCAL), ARCH(VOLTA), ARCH(TURING), ARCH(AMPERE), ARCH(ADA),
    ARCH(HOPPER), ARCH(BLACKWELL), ARCH(RUBIN),
};
#define BRAND(b) { #b, NVML_BRAND_##b }
static const struct name BRANDS[] = {
    BRAND(UNKNOWN), BRAND(QUADRO), BRAND(TESLA), BRAND(NVS), BRAND(GRID), BRAND(GEFORCE), BRAND(TITAN),
    BRAND(NVIDIA_VAPPS), BRAND(NVIDIA_VPC), BRAND(NVIDIA_VCS), BRAND(NVIDIA_VWS), BRAND(NVIDIA_CLOUD_GAMING),
    BRAND(QUADRO_RTX), BRAND(NVIDIA_RTX), BRAND(NVIDIA), BRAND(GEFORCE_RTX), BRAND(TITAN_RTX),
    BRAND(NVIDIA_DLA), BRAND(NVIDIA_VGAMEDEV), BRAND(NVIDIA_NPU),
};

/* The loaded driver as the state file describes it; written only by read_state. */
static struct {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int cuda_driver_version;
    char product_name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned long long memory_total_bytes;
    int compute_major, compute_minor;
    unsigned int architecture, brand, pci_device_id, pci_subsystem_id;
    unsigned int gpu_count;
    struct nvmlDevice_st gpus[MAX_GPUS];
} node;

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_uint init_count;

/* Callers start n at -1; sscanf's %n sets it only once the whole format matched, and the value must end there. */
static bool whole(const char *text, int n)
{
    return n >= 0 && text[n] == '\0';
}

static bool lookup(const struct name *names, size_t count, const char *text, unsigned int *value)
{
    for (size_t i = 0; i < count; i++) {
        if (strcmp(names[i].name, text) == 0) {
            *value = names[i].value;
            return true;
        }
    }
    return false;
}

/* GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in lowercase hex, as NVML and nvidia-smi -L print it. */
static bool is_gpu_uuid(const char *text)
{
    static const char shape[] = "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx";
    for (size_t i = 0; i < sizeof shape - 1; i++) {
        unsigned char c = (unsigned char)text[i];
        if (shape[i] == 'x' ? !isxdigit(c) || isupper(c) : text[i] != shape[i])
            return false;
    }
    return text[sizeof shape - 1] == '\0';
}

/* The three forms nvmlDeviceGetHandleByPciBusId_v2 accepts (hex): domain:bus:device.function,
 * domain:bus:device, bus:device.function. NVML names a GPU by its function 0. */
static bool parse_bus_id(const char *text, unsigned int *domain, unsigned int *bus, unsigned int *device)
{
    unsigned int function = 0;
    int n = -1;
    bool parsed = sscanf(text, "%x:%x:%x.%x%n", domain, bus, device, &function, &n) == 4 && whole(text, n);
    if (!parsed) {
        n = -1;
        parsed = sscanf(text, "%x:%x:%x%n", domain, bus, device, &n) == 3 && whole(text, n);
    }
    if (!parsed) {
        n = -1;
        *domain = 0;
        parsed = sscanf(text, "%x:%x.%x%n", bus, device, &function, &n) == 3 && whole(text, n);
    }
    return parsed && *bus <= 0xff && *device <= 0x1f && function == 0;
}

static const char *copy_value(char *to, size_t size, const char *value)
{
    if (strlen(value) >= size)
        return "value too long";
    strcpy(to, value);
    return NULL;
}

static const char *parse_device(const char *value)
{
    if (node.gpu_count == MAX_GPUS)
        return "more than 64 DEVICE lines";
    struct nvmlDevice_st *gpu = &node.gpus[node.gpu_count];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    int n = -1;
    if (sscanf(value, "%95s %31s %u%n", gpu->uuid, bus_id, &gpu->minor, &n) != 3 || !whole(value, n))
        return "DEVICE must be '<uuid> <pci bus id> <minor>'";
    if (!is_gpu_uuid(gpu->uuid))
        return "DEVICE's UUID is not GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (lowercase hex)";
    if (!parse_bus_id(bus_id, &gpu->domain, &gpu->bus, &gpu->device))
        return "DEVICE's PCI bus id is not domain:bus:device.0 in hex";
    node.gpu_count++;
    return NULL;
}

/* One KEY=VALUE line into `node`; returns what is wrong with it, or NULL. */
static const char *parse_line(const char *key, const char *value, unsigned int *seen)
{
    enum key k = 0;
    while (k < KEY_COUNT && strcmp(KEY_NAMES[k], key) != 0)
        k++;
    if (k == KEY_COUNT)
        return "unknown key";
    *seen |= 1u << k;
    int n = -1;
    switch (k) {
    case DRIVER_VERSION:
        return copy_value(node.driver_version, sizeof node.driver_version, value);
    case CUDA_DRIVER_VERSION:
        sscanf(value, "%d%n", &node.cuda_driver_version, &n);
        return whole(value, n) ? NULL : "CUDA_DRIVER_VERSION is not an integer";
    case PRODUCT_NAME:
        return copy_value(node.product_name, sizeof node.product_name, value);
    case MEMORY_TOTAL_BYTES:
        sscanf(value, "%llu%n", &node.memory_total_bytes, &n);
        return whole(value, n) ? NULL : "MEMORY_TOTAL_BYTES is not an integer";
    case CUDA_COMPUTE_CAPABILITY:
        sscanf(value, "%d.%d%n", &node.compute_major, &node.compute_minor, &n);
        return whole(value, n) ? NULL : "CUDA_COMPUTE_CAPABILITY is not major.minor";
    case ARCHITECTURE:
        return lookup(ARCHITECTURES, sizeof ARCHITECTURES / sizeof *ARCHITECTURES, value, &node.architecture)
            ? NULL : "ARCHITECTURE is not an NVML_DEVICE_ARCH_ suffix (HOPPER, BLACKWELL...)";
    case BRAND:
        return lookup(BRANDS, sizeof BRANDS / sizeof *BRANDS, value, &node.brand)
            ? NULL : "BRAND is not an NVML_BRAND_ suffix (NVIDIA, TESLA...)";
    case PCI_DEVICE_ID:
        sscanf(value, "%x%n", &node.pci_device_id, &n);
        return whole(value, n) ? NULL : "PCI_DEVICE_ID is not hex";
    case PCI_SUBSYSTEM_ID:
        sscanf(value, "%x%n", &node.pci_subsystem_id, &n);
        return whole(value, n) ? NULL : "PCI_SUBSYSTEM_ID is not hex";
    case DEVICE:
        return parse_device(value);
    case KEY_COUNT:
        break;
    }
    return "unknown key";
}

/* `line` 0: the file as a whole. */
static nvmlReturn_t complain(const char *path, unsigned int line, const char *problem)
{
    if (line > 0)
        fprintf(stderr, "libnvidia-ml (gpucanary NVML shim): %s:%u: %s\n", path, line, problem);
    else
        fprintf(stderr, "libnvidia-ml (gpucanary NVML shim): %s: %s\n", path, problem);
    return NVML_ERROR_UNKNOWN;
}

static nvmlReturn_t read_state(void)
{
    const char *path = getenv("GPUCANARY_NVML_STATE");
    if (path == NULL || *path == '\0')
        path = DEFAULT_STATE_PATH;
    FILE *file = fopen(path, "r");
    if (file == NULL)
        return errno == ENOENT ? NVML_ERROR_DRIVER_NOT_LOADED : complain(path, 0, strerror(errno));
    memset(&node, 0, sizeof node);
    char line[512];
    unsigned int line_number = 0, seen = 0;
    const char *problem = NULL;
    while (problem == NULL && fgets(line, sizeof line, file) != NULL) {
        line_number++;
        char *end = strchr(line, '\n');
        if (end == NULL && !feof(file)) {
            problem = "line longer than 510 bytes";
            break;
        }
        line[strcspn(line, "\r\n")] = '\0';
        if (line[0] == '\0' || line[0] == '#')
            continue;
        char *value = strchr(line, '=');
        if (value == NULL) {
            problem = "not KEY=VALUE";
            break;
        }
        *value++ = '\0';
        problem = parse_line(line, value, &seen);
    }
    fclose(file);
    if (problem != NULL)
        return complain(path, line_number, problem);
    if (node.driver_version[0] == '\0')
        return NVML_ERROR_DRIVER_NOT_LOADED;
    for (enum key k = 0; k < KEY_COUNT; k++) {
        if (!(seen & 1u << k)) {
            snprintf(line, sizeof line, "no %s line (a loaded driver needs every key)", KEY_NAMES[k]);
            return complain(path, 0, line);
        }
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t init(void)
{
    pthread_mutex_lock(&init_lock);
    nvmlReturn_t ret = atomic_load(&init_count) > 0 ? NVML_SUCCESS : read_state();
    if (ret == NVML_SUCCESS)
        atomic_fetch_add(&init_count, 1);
    pthread_mutex_unlock(&init_lock);
    return ret;
}

static nvmlReturn_t initialized(void)
{
    return atomic_load(&init_count) > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

/* The checks every device query starts with, in NVML's order: init, then arguments. */
static nvmlReturn_t find_gpu(nvmlDevice_t device, const void *out, const struct nvmlDevice_st **gpu)
{
    if (initialized() != NVML_SUCCESS)
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = 0; i < node.gpu_count; i++) {
        if (device.handle == &node.gpus[i]) {
            *gpu = &node.gpus[i];
            return out == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

static nvmlReturn_t copy_out(char *to, unsigned int length, const char *value)
{
    if (to == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(to, value);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return init();
}

nvmlReturn_t nvmlInit(void)
{
    return init();
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NVML_INIT_FLAG_*: nothing here enumerates or attaches hardware */
    return init();
}

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&init_lock);
    nvmlReturn_t ret = initialized();
    if (ret == NVML_SUCCESS)
        atomic_fetch_sub(&init_count, 1);
    pthread_mutex_unlock(&init_lock);
    return ret;
}

/* NVIDIA's strings for the codes this library returns, as libnvidia-ml prints them (DCGM's
 * nvml_error_strings.h; ARGUMENT_VERSION_MISMATCH as go-nvml issue #138 quotes it). */
const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t ret = initialized();
    return ret == NVML_SUCCESS ? copy_out(version, length, node.driver_version) : ret;
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t ret = initialized();
    if (ret != NVML_SUCCESS)
        return ret;
    char nvml_version[sizeof NVML_API_VERSION_STR + sizeof node.driver_version];
    snprintf(nvml_version, sizeof nvml_version, "%s.%s", NVML_API_VERSION_STR, node.driver_version);
    return copy_out(version, length, nvml_version);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t ret = initialized();
    if (ret == NVML_SUCCESS && cudaDriverVersion == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *cudaDriverVersion = node.cuda_driver_version;
    return ret;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t ret = initialized();
    if (ret == NVML_SUCCESS && deviceCount == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *deviceCount = node.gpu_count;
    return ret;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t ret = initialized();
    if (ret == NVML_SUCCESS && (device == NULL || index >= node.gpu_count))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        device->handle = &node.gpus[index];
    return ret;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t ret = initialized();
    if (ret != NVML_SUCCESS)
        return ret;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < node.gpu_count; i++) {
        if (strcmp(node.gpus[i].uuid, uuid) == 0) {
            device->handle = &node.gpus[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    nvmlReturn_t ret = initialized();
    if (ret != NVML_SUCCESS)
        return ret;
    unsigned int domain, bus, dev;
    if (pciBusId == NULL || device == NULL || !parse_bus_id(pciBusId, &domain, &bus, &dev))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < node.gpu_count; i++) {
        const struct nvmlDevice_st *gpu = &node.gpus[i];
        if (gpu->domain == domain && gpu->bus == bus && gpu->device == dev) {
            device->handle = &node.gpus[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, name, &gpu);
    return ret == NVML_SUCCESS ? copy_out(name, length, node.product_name) : ret;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, uuid, &gpu);
    return ret == NVML_SUCCESS ? copy_out(uuid, length, gpu->uuid) : ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, memory, &gpu);
    if (ret == NVML_SUCCESS)
        *memory = (nvmlMemory_t){ .total = node.memory_total_bytes, .free = node.memory_total_bytes };
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, memory, &gpu);
    if (ret == NVML_SUCCESS && memory->version != nvmlMemory_v2)
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (ret == NVML_SUCCESS)
        *memory = (nvmlMemory_v2_t){
            .version = nvmlMemory_v2, .total = node.memory_total_bytes, .free = node.memory_total_bytes,
        };
    return ret;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, pci, &gpu);
    if (ret != NVML_SUCCESS)
        return ret;
    *pci = (nvmlPciInfo_t){
        .domain = gpu->domain, .bus = gpu->bus, .device = gpu->device,
        .pciDeviceId = node.pci_device_id, .pciSubSystemId = node.pci_subsystem_id,
    };
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             NVML_DEVICE_PCI_BUS_ID_FMT_ARGS(pci));
    snprintf(pci->busId, sizeof pci->busId, NVML_DEVICE_PCI_BUS_ID_FMT, NVML_DEVICE_PCI_BUS_ID_FMT_ARGS(pci));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, minorNumber, &gpu);
    if (ret == NVML_SUCCESS)
        *minorNumber = gpu->minor;
    return ret;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, index, &gpu);
    if (ret == NVML_SUCCESS)
        *index = (unsigned int)(gpu - node.gpus);
    return ret;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, major, &gpu);
    if (ret == NVML_SUCCESS && minor == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        *major = node.compute_major;
        *minor = node.compute_minor;
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, arch, &gpu);
    if (ret == NVML_SUCCESS)
        *arch = node.architecture;
    return ret;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, type, &gpu);
    if (ret == NVML_SUCCESS)
        *type = (nvmlBrandType_t)node.brand;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, currentMode, &gpu);
    if (ret == NVML_SUCCESS)
        ret = pendingMode == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

/* NVIDIA's DRA kubelet plugin (sigs.k8s.io/dra-driver-nvidia-gpu) asks every GPU for each GPU instance
 * profile while it enumerates, without checking MIG mode first; NOT_SUPPORTED (as on a GPU without MIG)
 * makes it skip the profile. */
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, info, &gpu);
    if (ret == NVML_SUCCESS)
        ret = profile < NVML_GPU_INSTANCE_PROFILE_COUNT ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    return ret;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, isMigDevice, &gpu);
    if (ret == NVML_SUCCESS)
        *isMigDevice = 0;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, count, &gpu);
    if (ret == NVML_SUCCESS)
        *count = 0;
    return ret;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 nvmlGpuTopologyLevel_t *pathInfo)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device1, pathInfo, &gpu);
    if (ret == NVML_SUCCESS)
        ret = find_gpu(device2, pathInfo, &gpu);
    if (ret == NVML_SUCCESS)
        *pathInfo = NVML_TOPOLOGY_SYSTEM;
    return ret;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, isActive, &gpu);
    if (ret == NVML_SUCCESS)
        ret = link < NVML_NVLINK_MAX_LINKS ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    return ret;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, eventTypes, &gpu);
    if (ret == NVML_SUCCESS)
        *eventTypes = SUPPORTED_EVENTS;
    return ret;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t ret = initialized();
    if (ret == NVML_SUCCESS && set == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        set->handle = &event_set;
    return ret;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    const struct nvmlDevice_st *gpu;
    nvmlReturn_t ret = find_gpu(device, set.handle, &gpu);
    if (ret == NVML_SUCCESS && set.handle != &event_set)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && (eventTypes & ~SUPPORTED_EVENTS) != 0)
        ret = NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    nvmlReturn_t ret = initialized();
    if (ret != NVML_SUCCESS)
        return ret;
    if (set.handle != &event_set || data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec wait = { .tv_sec = timeoutms / 1000, .tv_nsec = (long)(timeoutms % 1000) * 1000000L };
    nanosleep(&wait, NULL); /* a signal ends the wait early, which nvml.h allows */
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    (void)set;
    return initialized();
}
