// Command nvml-check loads a libnvidia-ml.so.1 through NVIDIA's own Go bindings, go-nvml v0.13.4-1,
// with go-nvlib and go-gpuallocator on top as k8s-device-plugin v0.19.3 and GPU feature discovery
// use them, and prints what they see as one JSON object per line: the nvmlInit result, the driver,
// NVML and CUDA driver versions, and per GPU its name, UUID, memory, PCI bus id, minor number and
// compute capability; go-nvlib's view of each device (the strings GFD turns into labels, and its
// MIG, fabric and coherence checks); the device plugin's preferred allocation of 2 GPUs
// (go-gpuallocator's best-effort policy); a wait on an event set; and the return of every other
// call, by NVML function (and device index). It is the test client of ci/node/nvml-shim
// (tests/unit/test_nvml_shim.py) and prints the same fields against a real driver.
//
// Flags: -lib PATH (default: libnvidia-ml.so.1 beside this binary); -rounds N (default 1): each round
// is nvmlInit, the queries, nvmlShutdown, and before each round after the first it waits for a line on
// stdin, so a test can change the node's driver between rounds while this process lives. Exit codes:
// 0 every round printed, whatever NVML answered; 2 stdin ended before a round; 4 bad flags.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/NVIDIA/go-gpuallocator/gpuallocator"
	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// eventWaitMs is short so a round stays fast; the device plugin's health check waits 5000 ms.
const eventWaitMs = 100

type call struct {
	Code  int    `json:"code"`
	Error string `json:"error"`
}

type gpu struct {
	Index             int    `json:"index"`
	Name              string `json:"name"`
	UUID              string `json:"uuid"`
	MemoryTotalBytes  uint64 `json:"memory_total_bytes"`
	MemoryFreeBytes   uint64 `json:"memory_free_bytes"`
	MemoryV2Total     uint64 `json:"memory_v2_total_bytes"`
	PCIBusID          string `json:"pci_bus_id"`
	PCIDeviceID       uint32 `json:"pci_device_id"`
	Minor             int    `json:"minor"`
	ComputeCapability string `json:"compute_capability"`
	Architecture      uint32 `json:"architecture"`
	Brand             uint32 `json:"brand"`
	IndexByUUID       int    `json:"index_by_uuid"`
	IndexByPCIBusID   int    `json:"index_by_pci_bus_id"`
}

// nvlibGPU is go-nvlib's device.Device as the device plugin and GFD read it.
type nvlibGPU struct {
	PCIBusID          string `json:"pci_bus_id"`
	Architecture      string `json:"architecture"`
	Brand             string `json:"brand"`
	ComputeCapability string `json:"compute_capability"`
	MigCapable        bool   `json:"mig_capable"`
	MigEnabled        bool   `json:"mig_enabled"`
	FabricAttached    bool   `json:"fabric_attached"`
	Coherent          bool   `json:"coherent"`
}

type round struct {
	Init                call            `json:"init"`
	Calls               map[string]call `json:"calls"`
	DriverVersion       string          `json:"driver_version"`
	NVMLVersion         string          `json:"nvml_version"`
	CudaDriverVersion   int             `json:"cuda_driver_version"`
	CudaDriverVersionV2 int             `json:"cuda_driver_version_v2"`
	Count               int             `json:"count"`
	GPUs                []gpu           `json:"gpus"`
	Nvlib               []nvlibGPU      `json:"nvlib"`
	NvlibError          string          `json:"nvlib_error"`
	PreferredAllocation []string        `json:"preferred_allocation"`
	AllocatorError      string          `json:"allocator_error"`
	IsMigDevice         bool            `json:"is_mig_device"`
	MaxMigDeviceCount   int             `json:"max_mig_device_count"`
	EventWaitMs         float64         `json:"event_wait_ms"`
	Shutdown            call            `json:"shutdown"`
}

func result(ret nvml.Return) call {
	return call{Code: int(ret), Error: nvml.ErrorString(ret)}
}

// record keeps a call's return under name and says whether it succeeded.
func (r *round) record(name string, ret nvml.Return) bool {
	r.Calls[name] = result(ret)
	return ret == nvml.SUCCESS
}

func main() {
	exe, _ := os.Executable()
	flags := flag.NewFlagSet("nvml-check", flag.ContinueOnError)
	flags.SetOutput(io.Discard) // one line on stderr, not the flag package's usage dump
	lib := flags.String("lib", filepath.Join(filepath.Dir(exe), "libnvidia-ml.so.1"), "libnvidia-ml.so.1 to load")
	rounds := flags.Int("rounds", 1, "nvmlInit/nvmlShutdown rounds; each after the first waits for a line on stdin")
	if err := flags.Parse(os.Args[1:]); err != nil || *rounds < 1 || flags.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "nvml-check: error: usage: nvml-check [-lib PATH] [-rounds N>=1]")
		os.Exit(4)
	}
	nvmllib := nvml.New(nvml.WithLibraryPath(*lib))
	stdin := bufio.NewScanner(os.Stdin)
	out := json.NewEncoder(os.Stdout)
	for i := 0; i < *rounds; i++ {
		if i > 0 && !stdin.Scan() {
			fmt.Fprintf(os.Stderr, "nvml-check: error: stdin ended before round %d\n", i+1)
			os.Exit(2)
		}
		_ = out.Encode(query(nvmllib))
	}
}

func query(nvmllib nvml.Interface) round {
	r := round{Calls: map[string]call{}, GPUs: []gpu{}, Nvlib: []nvlibGPU{}, PreferredAllocation: []string{}}
	ret := nvmllib.Init()
	r.Init = result(ret)
	var count int
	r.DriverVersion, ret = nvmllib.SystemGetDriverVersion()
	r.record("SystemGetDriverVersion", ret)
	count, ret = nvmllib.DeviceGetCount()
	if r.record("DeviceGetCount", ret) {
		r.Count = count
	}
	if r.Init.Code == int(nvml.SUCCESS) {
		querySystem(nvmllib, &r)
		for index := 0; index < r.Count; index++ {
			r.GPUs = append(r.GPUs, queryGPU(nvmllib, &r, index))
		}
		queryNvlib(nvmllib, &r)
		queryAllocator(nvmllib, &r)
		queryDevice0(nvmllib, &r)
	}
	r.Shutdown = result(nvmllib.Shutdown())
	return r
}

func querySystem(nvmllib nvml.Interface, r *round) {
	var ret nvml.Return
	r.NVMLVersion, ret = nvmllib.SystemGetNVMLVersion()
	r.record("SystemGetNVMLVersion", ret)
	r.CudaDriverVersion, ret = nvmllib.SystemGetCudaDriverVersion()
	r.record("SystemGetCudaDriverVersion", ret)
	r.CudaDriverVersionV2, ret = nvmllib.SystemGetCudaDriverVersion_v2()
	r.record("SystemGetCudaDriverVersion_v2", ret)
	_, ret = nvmllib.DeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
	r.record("DeviceGetHandleByUUID/unknown", ret)
}

func queryGPU(nvmllib nvml.Interface, r *round, index int) gpu {
	g := gpu{Index: index, IndexByUUID: -1, IndexByPCIBusID: -1}
	at := func(name string) string { return fmt.Sprintf("%s/%d", name, index) }
	dev, ret := nvmllib.DeviceGetHandleByIndex(index)
	if !r.record(at("DeviceGetHandleByIndex"), ret) {
		return g
	}
	g.Name, ret = dev.GetName()
	r.record(at("DeviceGetName"), ret)
	g.UUID, ret = dev.GetUUID()
	r.record(at("DeviceGetUUID"), ret)
	memory, ret := dev.GetMemoryInfo()
	r.record(at("DeviceGetMemoryInfo"), ret)
	g.MemoryTotalBytes, g.MemoryFreeBytes = memory.Total, memory.Free
	memoryV2, ret := dev.GetMemoryInfo_v2()
	r.record(at("DeviceGetMemoryInfo_v2"), ret)
	g.MemoryV2Total = memoryV2.Total
	pci, ret := dev.GetPciInfo()
	r.record(at("DeviceGetPciInfo"), ret)
	g.PCIBusID, g.PCIDeviceID = cString(pci.BusId[:]), pci.PciDeviceId
	g.Minor, ret = dev.GetMinorNumber()
	r.record(at("DeviceGetMinorNumber"), ret)
	major, minor, ret := dev.GetCudaComputeCapability()
	r.record(at("DeviceGetCudaComputeCapability"), ret)
	g.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
	arch, ret := dev.GetArchitecture()
	r.record(at("DeviceGetArchitecture"), ret)
	brand, ret := dev.GetBrand()
	r.record(at("DeviceGetBrand"), ret)
	g.Architecture, g.Brand = uint32(arch), uint32(brand)
	if byUUID, ret := nvmllib.DeviceGetHandleByUUID(g.UUID); r.record(at("DeviceGetHandleByUUID"), ret) {
		g.IndexByUUID, ret = byUUID.GetIndex()
		r.record(at("DeviceGetIndex(by UUID)"), ret)
	}
	if byBusID, ret := nvmllib.DeviceGetHandleByPciBusId(g.PCIBusID); r.record(at("DeviceGetHandleByPciBusId"), ret) {
		g.IndexByPCIBusID, ret = byBusID.GetIndex()
		r.record(at("DeviceGetIndex(by PCI bus id)"), ret)
	}
	return g
}

func cString(chars []int8) string {
	bytes := make([]byte, 0, len(chars))
	for _, c := range chars {
		if c == 0 {
			break
		}
		bytes = append(bytes, byte(c))
	}
	return string(bytes)
}

func queryNvlib(nvmllib nvml.Interface, r *round) {
	devices, err := device.New(nvmllib).GetDevices()
	if err != nil {
		r.NvlibError = err.Error()
		return
	}
	for _, d := range devices {
		var g nvlibGPU
		var errs [8]error
		g.PCIBusID, errs[0] = d.GetPCIBusID()
		g.Architecture, errs[1] = d.GetArchitectureAsString()
		g.Brand, errs[2] = d.GetBrandAsString()
		g.ComputeCapability, errs[3] = d.GetCudaComputeCapabilityAsString()
		g.MigCapable, errs[4] = d.IsMigCapable()
		g.MigEnabled, errs[5] = d.IsMigEnabled()
		g.FabricAttached, errs[6] = d.IsFabricAttached()
		g.Coherent, errs[7] = d.IsCoherent()
		for _, err := range errs {
			if err != nil && r.NvlibError == "" {
				r.NvlibError = err.Error()
			}
		}
		r.Nvlib = append(r.Nvlib, g)
	}
}

// queryAllocator is k8s-device-plugin's alignedAlloc (internal/rm/nvml_manager.go): the kubelet's
// GetPreferredAllocation for 2 of the node's GPUs.
func queryAllocator(nvmllib nvml.Interface, r *round) {
	devices, err := gpuallocator.NewDevices(gpuallocator.WithNvmlLib(nvmllib))
	if err != nil {
		r.AllocatorError = err.Error()
		return
	}
	for _, d := range gpuallocator.NewBestEffortPolicy().Allocate(devices, nil, 2) {
		r.PreferredAllocation = append(r.PreferredAllocation, d.UUID)
	}
}

// queryDevice0 makes the calls the device plugin's health check and MIG and topology probes make.
func queryDevice0(nvmllib nvml.Interface, r *round) {
	dev, ret := nvmllib.DeviceGetHandleByIndex(0)
	if !r.record("DeviceGetHandleByIndex/0", ret) {
		return
	}
	_, _, ret = dev.GetMigMode()
	r.record("DeviceGetMigMode/0", ret)
	_, ret = dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	r.record("DeviceGetGpuInstanceProfileInfo/0", ret)
	r.IsMigDevice, ret = dev.IsMigDeviceHandle()
	r.record("DeviceIsMigDeviceHandle/0", ret)
	r.MaxMigDeviceCount, ret = dev.GetMaxMigDeviceCount()
	r.record("DeviceGetMaxMigDeviceCount/0", ret)
	_, ret = dev.GetNvLinkState(0)
	r.record("DeviceGetNvLinkState/0", ret)
	set, ret := nvmllib.EventSetCreate()
	if !r.record("EventSetCreate", ret) {
		return
	}
	supported, ret := dev.GetSupportedEventTypes()
	r.record("DeviceGetSupportedEventTypes/0", ret)
	mask := uint64(nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError)
	r.record("DeviceRegisterEvents/0", dev.RegisterEvents(mask&supported, set))
	started := time.Now()
	_, ret = set.Wait(eventWaitMs)
	r.EventWaitMs = float64(time.Since(started).Microseconds()) / 1000
	r.record("EventSetWait", ret)
	r.record("EventSetFree", set.Free())
}
