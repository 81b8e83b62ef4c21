@0xb5f3c0a1d2e4f607;
# The PCP wire contract. One Envelope per frame, in standard Cap'n Proto stream
# framing (segment table + segments). The raw bytes of every tensor named in
# `Envelope.tensors` follow the message on the stream, in list order, each
# exactly `payloadBytes` long: big tensors never pass through a Cap'n Proto Data
# field (too slow to build and copy for hundreds of MB).

struct Envelope {
  version @0 :UInt16;
  tensors @1 :List(TensorHeader);
  union {
    hello @2 :Hello;
    workerHello @3 :WorkerHello;
    welcome @4 :Welcome;
    plan @5 :Plan;
    ready @6 :Ready;
    roundStart @7 :RoundStart;
    progress @8 :Progress;
    roundResult @9 :RoundResult;
    heartbeat @10 :Heartbeat;
    error @11 :Error;
    goodbye @12 :Goodbye;
    fragmentUpdate @13 :FragmentUpdate;
    relayFrame @14 :RelayFrame;
    fold @15 :Fold;
    folded @16 :Folded;
  }
}

enum DType {
  float32 @0;
  float16 @1;
  bfloat16 @2;
  float64 @3;
  int8 @4;
  int16 @5;
  int32 @6;
  int64 @7;
  uint8 @8;
  uint16 @9;
  uint32 @10;
  uint64 @11;
  bool @12;
}

enum Quantization {
  none @0;       # payload is the array itself, little-endian, C order
  bfloat16 @1;   # float32 sent as bfloat16 (round to nearest even)
  int8Block @2;  # int8 values, then one float32 scale per `blockSize` elements
  int4Block @3;  # values in -7..7, two per byte (low nibble first), then the scales
}

struct TensorHeader {
  name @0 :Text;
  dtype @1 :DType;             # dtype of the array after decoding
  shape @2 :List(UInt64);
  quantization @3 :Quantization;
  payloadBytes @4 :UInt64;     # raw bytes following the message for this tensor
  blockSize @5 :UInt32;        # int8Block and int4Block only
}

enum Platform {
  cpu @0;
  cuda @1;
  rocm @2;
  metal @3;
  vulkan @4;
}

enum Runtime {
  xla @0;   # XLA through JAX, on the platform's JAX plugin
  iree @1;  # IREE, compiling the graph's StableHLO on the worker
}

enum Phase {
  compiling @0;
  training @1;
  syncing @2;
  idle @3;
}

# Streaming DiLoCo: how a fragment's new global value G merges into the local θ after the
# overlap steps. Added in protocol 5: a plan asking for carry is stamped 5.
enum OverlapMerge {
  mix @0;    # the paper's: θ ← α θ + (1 − α) G
  carry @1;  # θ ← θ + (1 − α)(G − θ at the send point): the overlap steps' progress is kept
}

enum BatchKind {
  windows @0;  # LM windows of shardTensor
  rows @1;     # random rows of dataTensors; a row counts as one token
}

struct BackendInfo {
  platform @0 :Platform;
  deviceKind @1 :Text;         # e.g. "NVIDIA H100 80GB HBM3", "cpu"
  deviceCount @2 :UInt32;
  memoryBytes @3 :UInt64;
  jaxVersion @4 :Text;
  runtime @5 :Runtime;         # what compiles and runs the graphs on this worker
  target @6 :Text;             # what it compiles for: the XLA platform, or IREE's e.g. "vulkan-spirv"
  # a site: one worker of several processes (multi-controller JAX, one a host), deviceCount
  # over all of them; 0 or 1 and no hostnames: one process (WorkerHello.hostname's)
  processCount @7 :UInt32;
  hostnames @8 :List(Text);    # each process's host, process 0's first
}

# shepherd -> worker, the first message on a connection.
struct Hello {
  supportedVersions @0 :List(UInt16);
  nonce @1 :Data;              # fresh random challenge for the join token
  runId @2 :Text;
  software @3 :Text;           # e.g. "pcp-tui 0.1.0"
}

# worker -> shepherd, answers Hello.
struct WorkerHello {
  supportedVersions @0 :List(UInt16);
  workerId @1 :Text;           # stable id chosen by the worker (survives reconnects)
  hostname @2 :Text;
  backend @3 :BackendInfo;
  proof @4 :Data;              # HMAC-SHA256(token, nonce || workerId); never the token
  software @5 :Text;
  # protocol 4, striped connections: 0 on a worker's own connection; i > 0 on the extra
  # connection i that it attaches to its session (the welcome's `streams` > 1), with
  # attachProof = HMAC-SHA256(the welcome's sessionKey, nonce || workerId || i)
  attachIndex @6 :UInt16;
  attachProof @7 :Data;
  # a shepherd with --worker-keys admits a worker whose Ed25519 key it lists under this
  # workerId: publicKey is its 32 bytes, signature Ed25519 over "pcp-tui workerHello" 0x00
  # || nonce || 0x00 || workerId || 0x00 || attachIndex in decimal (pcp_tui/contract/keys.py)
  publicKey @8 :Data;
  signature @9 :Data;
  # a relay (`pcp-tui relay`), not a worker: once welcomed, the connection carries its
  # workers' connections as channels (RelayFrame); workerId is the relay's name
  relay @10 :Bool;
  # a relay: the SHA-256 fingerprint of the certificate its workers see ("": they connect
  # over plain TCP); their --worker-keys signatures cover it, not the shepherd's
  relayFingerprint @11 :Text;
}

struct Welcome {
  workerIndex @0 :UInt32;
  runId @1 :Text;
  heartbeatSeconds @2 :Float32;
  # striped connections: streams > 1 asks
  # the worker to attach streams - 1 more connections with sessionKey; a second welcome on this
  # connection then says how many carry the session from its next byte on (1: this one alone)
  streams @3 :UInt16;
  sessionKey @4 :Data;
  keyChecked @5 :Bool;         # the shepherd checked the hello's signature (--worker-keys)
}

struct GraphInfo {
  name @0 :Text;               # train_chunk | init_opt_state
  platforms @1 :List(Platform);  # platforms the serialized jax.export artifact was lowered for
  tensor @2 :Text;             # name of the uint8 tensor that carries the serialized bytes
}

# shepherd -> worker: everything a worker needs to train, no model code.
struct Plan {
  runId @0 :Text;
  modelName @1 :Text;
  paramCount @2 :UInt64;
  graphs @3 :List(GraphInfo);
  paramNames @4 :List(Text);   # order of the parameter tensors in the graphs
  innerSteps @5 :UInt32;       # H
  chunkSteps @6 :UInt32;       # K: inner steps per compiled call
  batchSize @7 :UInt32;
  seqLen @8 :UInt32;
  seed @9 :UInt64;
  shardTensor @10 :Text;       # name of the tensor holding this worker's token shard
  shardFingerprint @11 :Text;  # sha256 of the shard bytes
  workerSlot @12 :UInt32;      # which shard / data stream this worker owns
  compression @13 :Quantization;   # how to send pseudo-gradients back
  batchKind @14 :BatchKind;
  dataTensors @15 :List(Text); # rows only: tensors [N, ...] sampled by row, in the graph's batch order
  tokensPerRow @16 :UInt32;    # tokens one batch row counts for: seqLen for windows, 1 for rows
  sharding @17 :Sharding;      # how a worker with several devices places the parameters
  fragments @18 :List(Fragment);  # the partition of paramNames (plain DiLoCo: one fragment)
  overlapSteps @19 :UInt32;    # inner steps between a fragment's send and its merge
  mixAlpha @20 :Float64;       # a merge keeps mixAlpha of the local fragment
  overlapMerge @21 :OverlapMerge;  # how the merge treats the overlap's progress
}

# The tensors of one fragment, synced together (Streaming DiLoCo; plain DiLoCo has one).
struct Fragment {
  tensors @0 :List(Text);
}

# How a worker with several local devices (one JAX mesh axis) places parameters and optimizer
# state; the batch is always split over the devices. A worker with one device ignores it.
enum ShardingMode {
  data @0;   # parameters not matched by a rule are copied to every device
  fsdp @1;   # parameters not matched by a rule are split across the devices if matrices
}

enum ParamLayout {
  replicated @0;  # a full copy on every device
  fsdp @1;        # split across the devices on its largest evenly divisible axis
}

struct ShardingRule {
  pattern @0 :Text;            # fnmatch pattern of parameter names, e.g. "h.*.mlp.*.w"
  layout @1 :ParamLayout;
}

struct Sharding {
  mode @0 :ShardingMode;
  rules @1 :List(ShardingRule);  # the first rule whose pattern matches a name decides
}

struct Ready {
  compileSeconds @0 :Float64;
  platform @1 :Platform;
}

# shepherd -> worker; the global parameters ride as tensors.
struct RoundStart {
  round @0 :UInt32;
  innerSteps @1 :UInt32;
  continued @2 :Bool;          # no tensors: go on from the worker's own (global) parameters
}

struct Progress {
  round @0 :UInt32;
  step @1 :UInt32;
  totalSteps @2 :UInt32;
  loss @3 :Float32;
  tokensPerSecond @4 :Float32;
  phase @5 :Phase;
  stats @6 :WorkerStats;
}

# What a worker measures about itself; rides on every progress message.
struct WorkerStats {
  steps @0 :UInt64;            # inner steps trained since the worker started
  tokens @1 :UInt64;           # tokens trained on since the worker started
  memoryInUseBytes @2 :UInt64; # device memory in use (the process's resident memory on CPU); 0: unknown
  memoryPeakBytes @3 :UInt64;  # the most it has used; 0: unknown
  memoryLimitBytes @4 :UInt64; # what the device offers; 0: unknown
  gpuUtilization @5 :Float32 = -1;  # 0..1, the device's busy share (NVML); -1: not measured
}

# worker -> shepherd at a fragment's send point; the fragment's pseudo-gradient (its
# global value at its last sync - local) rides as tensors. Plain DiLoCo: one fragment.
struct RoundResult {
  round @0 :UInt32;
  tokens @1 :UInt64;           # tokens the pseudo-gradient trained on (its weight)
  losses @2 :List(Float32);    # one per inner step since the previous roundResult
  computeSeconds @3 :Float64;  # spent on those steps
  innerSteps @4 :UInt32;       # those steps
  fragment @5 :UInt32;         # index into the plan's fragments
  # relay -> shepherd, in place of the worker's result: its relay folded it (no tensors ride),
  # with its weight, the factor centered clip scaled it by, its distance per unit of step
  # scale and its global norm (`Fold`; a worker's own result never sets these)
  folded @6 :Bool;
  weight @7 :Float64;
  scale @8 :Float64;
  distance @9 :Float64;
  norm @10 :Float64;
}

# shepherd -> worker once a fragment's outer step is done: its new global value rides
# as tensors.
struct FragmentUpdate {
  round @0 :UInt32;
  fragment @1 :UInt32;
  change @2 :Bool;             # tensors are the change since the fragment's last global value
}

struct Heartbeat {
  sentAt @0 :Float64;
}

enum ErrorCode {
  unknown @0;
  versionMismatch @1;
  authFailed @2;
  malformed @3;
  tooLarge @4;
  badResult @5;
  internal @6;
  shuttingDown @7;
  timeout @8;
  busy @9;
  unsupportedBackend @10;
  idInUse @11;  # another live connection holds this worker id: final, start with another --id
  unavailable @12;  # a relay that cannot carry a worker now (no link, full): try the next address
}

struct Error {
  code @0 :ErrorCode;
  message @1 :Text;
}

struct Goodbye {
  reason @0 :Text;
  # the shepherd stopped before the run's end with a checkpoint to resume from: a worker that
  # reads it reconnects (to `pcp-tui shepherd --resume`) instead of exiting.
  resumable @1 :Bool;
}

# relay <-> shepherd, after the relay's welcome: every message on the connection is a
# relayFrame. A channel is one worker's connection to the relay, carried byte for byte (the
# worker and the shepherd speak PCP through it as over TCP); a data or keep frame's bytes
# ride as one uint8 tensor. Each side may send a channel at most the bytes the other granted
# it (credit), so one slow reader never stalls the others: a frame goes once some credit is
# left, its own bytes within it, the kept buffers it names charged after.
enum RelayOp {
  open @0;    # relay -> shepherd: a worker connected; `text` is its address
  data @1;    # the channel's next bytes, with the kept buffers `kept` names at their places
  close @2;   # the channel ended; `text` says why
  credit @3;  # the receiver takes `value` more bytes of the channel
  keep @4;    # shepherd -> relay, channel 0: the next bytes of buffer `value`, to keep
  repeat @5;  # shepherd -> relay: the channel's next bytes are those of the kept buffers `kept`
  forget @6;  # shepherd -> relay: buffer `value` is not repeated again
}

struct RelayFrame {
  channel @0 :UInt32;
  op @1 :RelayOp;
  value @2 :UInt64;
  text @3 :Text;
  kept @4 :List(UInt64);    # data, repeat: kept buffers whose bytes go in (the shepherd's only)
  keptAt @5 :List(UInt64);  # where each goes: after this many of the frame's own bytes
}

# shepherd -> relay on the relay's control channel (the first it opens): fold round `round`'s
# fragment `fragment` results of this relay's workers with these numbers from now (close =
# false; the clip's center rides as tensors, none for the mean), or stop and answer with
# `folded` (close = true). A relay without an open fold passes results on whole.
struct Fold {
  round @0 :UInt32;
  fragment @1 :UInt32;
  close @2 :Bool;
  radius @3 :Float64;           # centered clip's; inf for the mean
  stepScale @4 :Float64;        # what the radius and the distances scale with
  measure @5 :Bool;             # take each result's distance from the center (centered clip)
  maxTokens @6 :UInt64;         # the screen: the most tokens a result may claim
  bound @7 :Float64;            # the screen: the largest norm the plan's optimizer can give
  normTypical @8 :Float64;      # the norm screen's baseline per unit of lr (0: none yet)
  normFactor @9 :Float64;
  perStep @10 :UInt64;          # tokens one inner step trains on
  lrSums @11 :List(Float64);    # Σ inner lr over a result of lrSteps[i] steps (the norm screen)
  shareWorkers @12 :List(Text); # workers whose tokens weigh `shares` each (--weight-per address)
  shares @13 :List(Float64);
  lrSteps @14 :List(UInt32);
  names @15 :List(Text);        # the fragment's parameters, with their shapes' dims
  dims @16 :List(UInt64);       # (`ranks[i]` of them each, in order)
  ranks @17 :List(UInt8);
  normCap @18 :Float64;         # centered clip's cap on a result's norm (inf: none)
}

# relay -> shepherd on its control channel, answering a closing fold: Σ w·s·Δ as tensors
# (none if it folded nothing), Σ w, Σ w (1 - s), and the workers whose results are in it.
struct Folded {
  round @0 :UInt32;
  fragment @1 :UInt32;
  weight @2 :Float64;
  centerWeight @3 :Float64;
  workers @4 :List(Text);
  weights @5 :List(Float64);    # each result's weight, scale and distance (`roundResult`'s)
  scales @6 :List(Float64);
  distances @7 :List(Float64);
  norms @8 :List(Float64);      # each result's norm per unit of step scale (the next cap)
}
