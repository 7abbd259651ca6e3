// Package nvfm is a compile-only stand-in for NVIDIA's go-nvfm bindings (see ../../go.mod): the types and
// calls sigs.k8s.io/dra-driver-nvidia-gpu v0.5.0 uses, none of them backed by libnvfm.so.
package nvfm

import "fmt"

// Return mirrors fmReturn_t.
type Return int32

const (
	SUCCESS              Return = 0
	BADPARAM             Return = -1
	GENERIC_ERROR        Return = -2
	NOT_SUPPORTED        Return = -3
	UNINITIALIZED        Return = -4
	TIMEOUT              Return = -5
	VERSION_MISMATCH     Return = -6
	IN_USE               Return = -7
	NOT_CONFIGURED       Return = -8
	CONNECTION_NOT_VALID Return = -9
	NVLINK_ERROR         Return = -10
	RESOURCE_BAD_STATE   Return = -11
	RESOURCE_IN_USE      Return = -12
	RESOURCE_NOT_IN_USE  Return = -13
	LIBRARY_NOT_FOUND    Return = -100 // the stand-in's own: there is no libnvfm.so behind it
)

var names = map[Return]string{
	SUCCESS: "SUCCESS", BADPARAM: "BADPARAM", GENERIC_ERROR: "GENERIC_ERROR", NOT_SUPPORTED: "NOT_SUPPORTED",
	UNINITIALIZED: "UNINITIALIZED", TIMEOUT: "TIMEOUT", VERSION_MISMATCH: "VERSION_MISMATCH", IN_USE: "IN_USE",
	NOT_CONFIGURED: "NOT_CONFIGURED", CONNECTION_NOT_VALID: "CONNECTION_NOT_VALID", NVLINK_ERROR: "NVLINK_ERROR",
	RESOURCE_BAD_STATE: "RESOURCE_BAD_STATE", RESOURCE_IN_USE: "RESOURCE_IN_USE",
	RESOURCE_NOT_IN_USE: "RESOURCE_NOT_IN_USE", LIBRARY_NOT_FOUND: "LIBRARY_NOT_FOUND (go-nvfm stand-in)",
}

func (r Return) String() string {
	if n, ok := names[r]; ok {
		return n
	}
	return fmt.Sprintf("fmReturn(%d)", int32(r))
}

func (r Return) Error() string { return r.String() }

// Sizes from nv_fm_types.h.
const (
	MAX_FABRIC_PARTITIONS      = 64
	MAX_NUM_GPUS               = 16
	UUID_BUFFER_SIZE           = 80
	DEVICE_PCI_BUS_ID_BUF_SIZE = 32
	MAX_NUM_NVLINK_PORTS       = 64
	MAX_NUM_NVLINK_FAILED_DEVS = 64
)

type FabricPartitionId uint32

type FabricPartitionGpuInfo struct {
	PhysicalId          uint32
	Uuid                [UUID_BUFFER_SIZE]int8
	PciBusId            [DEVICE_PCI_BUS_ID_BUF_SIZE]int8
	NumNvLinksAvailable uint32
	MaxNumNvLinks       uint32
	NvlinkLineRateMBps  uint32
}

type FabricPartitionInfo struct {
	PartitionId uint32
	IsActive    uint32
	NumGpus     uint32
	GpuInfo     [MAX_NUM_GPUS]FabricPartitionGpuInfo
}

type FabricPartitionList struct {
	Version          uint32
	NumPartitions    uint32
	MaxNumPartitions uint32
	PartitionInfo    [MAX_FABRIC_PARTITIONS]FabricPartitionInfo
}

type UnsupportedFabricPartitionInfo struct {
	PartitionId    uint32
	NumGpus        uint32
	GpuPhysicalIds [MAX_NUM_GPUS]uint32
}

type UnsupportedFabricPartitionList struct {
	Version       uint32
	NumPartitions uint32
	PartitionInfo [MAX_FABRIC_PARTITIONS]UnsupportedFabricPartitionInfo
}

type PciDevice struct {
	Domain   uint32
	Bus      uint32
	Device   uint32
	Function uint32
}

type NvlinkFailedDeviceInfo struct {
	Uuid     [UUID_BUFFER_SIZE]int8
	PciBusId [DEVICE_PCI_BUS_ID_BUF_SIZE]int8
	NumPorts uint32
	PortNum  [MAX_NUM_NVLINK_PORTS]uint32
}

type NvlinkFailedDevices struct {
	Version     uint32
	NumGpus     uint32
	NumSwitches uint32
	GpuInfo     [MAX_NUM_GPUS]NvlinkFailedDeviceInfo
	SwitchInfo  [MAX_NUM_NVLINK_FAILED_DEVS]NvlinkFailedDeviceInfo
}

// ConnectParams mirrors fmConnectParams_t.
type ConnectParams struct {
	AddressInfo         string
	TimeoutMs           uint32
	AddressIsUnixSocket bool
}

type ConnectOption func(*ConnectParams)

func WithAddress(a string) ConnectOption {
	return func(p *ConnectParams) { p.AddressInfo, p.AddressIsUnixSocket = a, false }
}
func WithUnixSocket(s string) ConnectOption {
	return func(p *ConnectParams) { p.AddressInfo, p.AddressIsUnixSocket = s, true }
}
func WithTimeoutMs(t uint32) ConnectOption { return func(p *ConnectParams) { p.TimeoutMs = t } }

// Handle is one connection to nv-fabricmanager.
type Handle interface {
	ActivateFabricPartition(FabricPartitionId) Return
	ActivateFabricPartitionWithVFs(FabricPartitionId, []PciDevice) Return
	DeactivateFabricPartition(FabricPartitionId) Return
	Disconnect() Return
	GetNvlinkFailedDevices() (NvlinkFailedDevices, Return)
	GetSupportedFabricPartitions() (FabricPartitionList, Return)
	GetUnsupportedFabricPartitions() (UnsupportedFabricPartitionList, Return)
	SetActivatedFabricPartitions([]FabricPartitionId) Return
}

// ExtendedInterface is go-nvfm's escape hatch; nothing here.
type ExtendedInterface interface{}

// Interface is the library.
type Interface interface {
	Connect(...ConnectOption) (Handle, Return)
	ConnectWithParams(ConnectParams) (Handle, Return)
	ErrorString(Return) string
	Extensions() ExtendedInterface
	Init() Return
	Shutdown() Return
}

type options struct{ path string }

type LibraryOption func(*options)

func WithLibraryPath(p string) LibraryOption { return func(o *options) { o.path = p } }

type library struct{ options }

// New returns a library whose every call reports LIBRARY_NOT_FOUND.
func New(opts ...LibraryOption) Interface {
	l := &library{}
	for _, o := range opts {
		o(&l.options)
	}
	return l
}

func (l *library) Connect(...ConnectOption) (Handle, Return)        { return nil, LIBRARY_NOT_FOUND }
func (l *library) ConnectWithParams(ConnectParams) (Handle, Return) { return nil, LIBRARY_NOT_FOUND }
func (l *library) ErrorString(r Return) string                      { return r.String() }
func (l *library) Extensions() ExtendedInterface                    { return nil }
func (l *library) Init() Return                                     { return LIBRARY_NOT_FOUND }
func (l *library) Shutdown() Return                                 { return LIBRARY_NOT_FOUND }
