//! Seeded synthetic data for the storage and retrieval benchmarks: clustered unit vectors
//! (embedding-like: many topics of Zipf-distributed sizes) and Zipf-distributed pseudo-words.

/// xorshift64*: fast, seeded, good enough for synthetic data.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Approximately standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        ((self.unit() + self.unit() + self.unit() + self.unit()) - 2.0) * 1.732
    }
    /// Zipf-like rank in `0..n` (exponent ≈ 1) by inverse transform on a log scale.
    pub fn zipf(&mut self, n: usize) -> usize {
        let u = self.unit().max(1e-7);
        (((n as f32).powf(u) - 1.0) as usize).min(n - 1)
    }
}

pub fn normalize(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= n);
}

/// `n` unit vectors around `n / 100` random topic centres.
pub fn clustered_vectors(n: usize, dims: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng(seed | 1);
    let centres: Vec<Vec<f32>> = (0..(n / 100).max(10))
        .map(|_| {
            let mut c: Vec<f32> = (0..dims).map(|_| rng.normal()).collect();
            normalize(&mut c);
            c
        })
        .collect();
    let sigma = 0.9 / (dims as f32).sqrt();
    (0..n)
        .map(|_| {
            let c = &centres[rng.zipf(centres.len())];
            let mut v: Vec<f32> = c.iter().map(|x| x + sigma * rng.normal()).collect();
            normalize(&mut v);
            v
        })
        .collect()
}

/// A pronounceable synthetic word for vocabulary rank `i`.
pub fn word(mut i: usize) -> String {
    const SYL: [&str; 16] = [
        "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ber", "dan", "gol", "hin", "jas", "kor",
        "lum", "pen",
    ];
    let mut w = String::new();
    loop {
        w.push_str(SYL[i % SYL.len()]);
        i /= SYL.len();
        if i == 0 {
            break;
        }
    }
    w
}

pub fn sentence(rng: &mut Rng, vocab: usize, len: usize) -> String {
    (0..len)
        .map(|_| word(rng.zipf(vocab)))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
